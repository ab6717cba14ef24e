"""Diagnostics: ``timeshare doctor``, ``bench residency``, ``bench switch`` and ``arena-test``
(the harness, its interval and memory checks). Product modules never import this package; what the
harness needs from the product comes through :mod:`..observe`."""
