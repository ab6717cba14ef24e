"""Why the in-place path is not used for a model: raised by its discovery and plan, caught by
``Residency.attach`` (which falls back to the rebuild path, or to no path at all)."""

from __future__ import annotations


class InPlaceUnsupportedError(Exception):
    """The in-place path cannot be used for this model here; the message is the reason."""


class NothingToReleaseError(InPlaceUnsupportedError):
    """The weights are memory-mapped on a CPU-only build: they are the page cache's, and there is
    nothing to release (the ``none`` path under ``mode="auto"``)."""
