"""Get models: ``timeshare pull`` and the tray's "Get model…", from Hugging Face or any URL.

Three steps, each usable alone (the CLI and the dialog drive them the same way):

1. :func:`sources.parse_source` reads what the user typed: ``user/repo``, ``user/repo:Q4_K_M``,
   ``user/repo/file.gguf`` (``hf.co/`` or ``https://huggingface.co/`` in front is accepted, and so
   is a hub ``/resolve/`` or ``/blob/`` URL), or the ``http(s)://`` URL of a ``.gguf`` file.
2. :func:`remote.list_source` asks the server what is there: the hub's model info (file sizes, the
   LFS sha256 of each file, the licence on the repo card) through ``huggingface_hub``, or a HEAD
   for a URL. A repo's GGUF files become :class:`sources.Choice` s, one per quantisation, a split
   model (``-00001-of-0000N``) being one choice of all its parts; :func:`sources.choose` picks one.
3. :func:`download.pull` downloads a choice and checks it before anything uses it.

Hub files go into the Hugging Face cache, in its layout (``models--user--repo/blobs/<etag>``, a
``snapshots/<commit>/<file>`` link, ``refs/<revision>``), so other tools (``hf``, llama.cpp,
the catalog) share them; ``HF_ENDPOINT``, ``HF_HUB_CACHE``/``HF_HOME`` and the token from
``HF_TOKEN`` or ``hf auth login`` are honoured. URL files go to ``<data dir>/models/`` (or
``--dir``).

Names from the remote: the ETag, the commit, a repo's file names and a URL's file name are checked
by :mod:`names` before any path is built from them (a hub or a URL may be hostile: ``HF_ENDPOINT``
points anywhere); every path must stay inside its folder after resolution, files are created
``O_EXCL | O_NOFOLLOW`` and renamed into place. A name that fails is an UnsafeNameError and nothing
is written.

Resuming: bytes go to a partial file next to the destination (``blobs/<etag>.incomplete``, the name
the hub cache has always used, or ``<file>.part``) that outlives Ctrl-C, a dropped connection or a
cancel when the server can resume it (size and version known, Range honoured, the start checked so
far; any other failed download deletes it); the next pull sends a Range request from its end (a
dropped connection is also retried on the spot, five times). A download is bounded by its announced
size, or by ``download.MAX_UNKNOWN_SIZE`` (``--max-size``) when the server says none, and by the
free space, checked as it grows. Checks, in order: the first bytes must be a GGUF whose
``general.architecture`` the installed llama.cpp loads (before the rest is downloaded); the size
must be the announced one; the sha256 must be the hub's (LFS files carry it); the whole header must
read (:func:`catalog.read_gguf_header`). A file that fails is deleted, never left to be loaded.

Nothing here imports Qt; :func:`add.add_to_config` writes the model into the config file.

Modules: ``sources`` (parsing a source; :class:`sources.Listing`, :class:`sources.Choice`,
choosing one; the GPU fit), ``remote`` (listing a hub repo or a URL; the HTTP client and the
sentences for the servers' errors), ``names`` (the checks on remote-chosen names, the containment
of paths, exclusive creation), ``targets`` (where a download's files live: the hub cache's
layout or a folder, partial files, locks, snapshot links), ``verify`` (the GGUF magic and
architecture from a file's first bytes, the sha256), ``progress`` (:class:`progress.Progress`
reports with a rate and an ETA), ``download`` (:func:`download.pull`: the resumable, retried
transfer and its checks), ``add`` (adding the pulled model to the config file).
"""
