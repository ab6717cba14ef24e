"""What a config field means to a person: its label, unit, range and help, written once.

Each field of the settings dataclasses (``schema``) is declared with :func:`setting`, which keeps
its default where the dataclass has it and hangs a :class:`FieldMeta` on the field. Validation
(``validate``: the range) and the Settings dialogs (``app/settings.py``: initial values, spin box
ranges, labels, tooltips) read them through :func:`describe` / :func:`default_of`, so no default or
range is written twice (qutebrowser's configdata idea).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, TypeVar

from ..words import for_device

T = TypeVar("T")

#: the key of a dataclass field's ``metadata`` that holds its FieldMeta
META_KEY = "timeshare"


@dataclass(frozen=True)
class FieldMeta:
    """One config field as a person sees it."""

    # what a form calls it (no trailing colon). Label, help and special may hold "{GPU words|CPU
    # words}" choices ("keeps {the GPU|its turn}"): read them through :meth:`worded`
    label: str
    help: str = ""  # one or two sentences: the tooltip, the example config's comment
    unit: str = ""  # "ms", "s", "tokens"... ("" for none); the Settings spin box's suffix
    minimum: float | None = None  # the least value the file may hold (None: no bound)
    maximum: float | None = None  # the most value the file may hold (None: no bound)
    strict_minimum: bool = False  # the value must be above ``minimum``, not equal to it
    # the most a Settings spin box offers where the file has no upper bound (``maximum`` None)
    ui_maximum: float | None = None
    # what the off/empty value (a spin box at its minimum, an empty text) means, as shown
    special: str = ""
    # the words a field offers (a combo box's items): the only values it takes, except where its
    # check takes more (vram_budget also takes a size or a share); empty: any text
    choices: tuple[str, ...] = ()

    def worded(self, gpu: bool) -> FieldMeta:
        """This field as a person reads it on a build with (``gpu``) or without a GPU: the
        "{GPU words|CPU words}" choices of its label, help and special made (core/words.py)."""
        return replace(
            self,
            label=for_device(self.label, gpu),
            help=for_device(self.help, gpu),
            special=for_device(self.special, gpu),
        )

    @property
    def top(self) -> float | None:
        """The largest value a Settings control offers: the file's bound, else ``ui_maximum``."""
        return self.maximum if self.maximum is not None else self.ui_maximum


@dataclass(frozen=True)
class Described:
    """A field of a settings dataclass: its name, default and :class:`FieldMeta`."""

    name: str
    default: Any
    meta: FieldMeta


def setting(default: T, meta: FieldMeta) -> T:
    """A dataclass field with ``default`` and ``meta`` (typed as its default, for mypy)."""
    out: T = field(default=default, metadata={META_KEY: meta})
    return out


def describe(cls: type, name: str) -> Described:
    """Field ``name`` of the settings dataclass ``cls``; KeyError for a field without metadata."""
    for f in fields(cls):
        if f.name == name:
            meta = f.metadata.get(META_KEY)
            if not isinstance(meta, FieldMeta):
                raise KeyError(f"{cls.__name__}.{name} has no FieldMeta")
            default = None if f.default is MISSING else f.default
            return Described(name, default, meta)
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def default_of(cls: type, name: str) -> Any:
    """The default of ``cls.name`` (None for a required field)."""
    return describe(cls, name).default


def described(cls: type) -> list[Described]:
    """Every field of ``cls`` that carries metadata, in declaration order."""
    return [describe(cls, f.name) for f in fields(cls) if META_KEY in f.metadata]
