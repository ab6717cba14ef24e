"""A model as people name it: the id, the display name, and what a pull names a new model.

Two resolvers, one rule each:

- :func:`resolve_api_model` (every HTTP route that takes a model): the id, or the display name,
  case-insensitively; never a prefix (a prefix unique today breaks a client when a model is added).
- :func:`resolve_cli_model` (the CLI): the same, plus a unique case-insensitive prefix of an id or
  a display name; an ambiguous one is an :class:`AmbiguousModelError` listing the candidates.

:func:`pulled_names` gives a pulled model its id and display name from what the user pulled
(the repo and the quantisation, else the file's stem; ``--id``/``--name`` win), unique in the
config. The GGUF's own ``general.name`` is a detail shown by ``timeshare show``, not the name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Protocol

from .config.schema import suggest_model_id


class Named(Protocol):
    """A ModelConfig or a ModelStatus: an id and a display name."""

    @property
    def id(self) -> str: ...

    @property
    def display_name(self) -> str: ...


class UnknownModelNameError(ValueError):
    """No model goes by that name; the message lists the configured ids."""


class AmbiguousModelError(ValueError):
    """Several models go by that name or prefix; ``candidates`` holds their ids."""

    def __init__(self, message: str, candidates: Sequence[str]) -> None:
        super().__init__(message)
        self.candidates = tuple(candidates)


def _exact(models: Sequence[Named], name: str) -> list[str]:
    """Ids of the models whose id, else whose display name, equals ``name`` case-insensitively
    (the id exactly first: ids are unique, display names in a hand-edited config may not be)."""
    if any(m.id == name for m in models):
        return [name]
    folded = name.casefold()
    by_id = [m.id for m in models if m.id.casefold() == folded]
    if by_id:
        return by_id
    return [m.id for m in models if m.display_name.casefold() == folded]


def resolve_api_model(models: Iterable[Named], name: str) -> str | None:
    """The id of the model ``name`` names (its id or its display name, any case), or None when
    none does or several do (the route answers its 404 naming the ids)."""
    found = _exact(list(models), name)
    return found[0] if len(found) == 1 else None


def resolve_cli_model(models: Iterable[Named], name: str) -> str:
    """The id of the model ``name`` names: its id or display name (any case), else a unique
    case-insensitive prefix of one. UnknownModelNameError / AmbiguousModelError otherwise."""
    listed = list(models)
    found = _exact(listed, name)
    if not found:
        folded = name.casefold()
        found = [
            m.id
            for m in listed
            if folded and (m.id.casefold().startswith(folded) or m.display_name.casefold().startswith(folded))
        ]
    if len(found) == 1:
        return found[0]
    if not found:
        known = ", ".join(m.id for m in listed) or "none are configured"
        raise UnknownModelNameError(f"no model is called {name!r}; the models are: {known}")
    shown = ", ".join(
        f"{m.id} ({m.display_name})" if m.display_name != m.id else m.id for m in listed if m.id in found
    )
    raise AmbiguousModelError(f"{name!r} could be {shown}: give more of the name", found)


_GGUF_SUFFIX = re.compile(r"[-_.]?gguf$", re.IGNORECASE)


def repo_label(repo_id: str) -> str:
    """A repo's name without its owner and without the "-GGUF" most GGUF repos end with."""
    name = repo_id.rsplit("/", 1)[-1]
    return _GGUF_SUFFIX.sub("", name) or name


def pulled_names(
    label: str,
    existing: Iterable[Named],
    *,
    model_id: str | None = None,
    name: str | None = None,
) -> tuple[str, str]:
    """(id, display name) for a model pulled as ``label`` ("SmolLM2-135M-Instruct Q8_0", a file
    stem): ``model_id``/``name`` when given, else derived from ``label``; the derived ones are
    made unique among ``existing`` (an id and a name never equal another model's id or name in
    any case, so either resolves to one model). A given ``model_id`` is the caller's to check."""
    models = list(existing)
    taken = {m.id for m in models}
    folded = {m.id.casefold() for m in models} | {m.display_name.casefold() for m in models}
    chosen_id = model_id or suggest_model_id(label, taken | folded)
    display = name or label
    if name is None:
        base, n = display, 2
        while display.casefold() in folded:
            display = f"{base} ({n})"
            n += 1
    return chosen_id, display
