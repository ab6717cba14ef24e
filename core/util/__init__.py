"""Small utilities with no home of their own: atomic file writes (``atomic``), byte sizes
(``units``), a thread-safe stream of text pieces (``stream``), logging set-up (``logsetup``)."""
