"""What the user typed, and what a source offers: step 1 of getting a model, and the choices.

:func:`parse_source` reads a Hugging Face repo (``user/repo``, ``user/repo:Q4_K_M``,
``user/repo/file.gguf``, with ``hf.co/`` or ``https://huggingface.co/`` in front, or a hub
``/resolve/`` or ``/blob/`` URL) or the ``http(s)://`` URL of a ``.gguf`` file. A
:class:`Listing` (what ``remote.list_source`` answers) holds :class:`Choice` s, one per
quantisation, a split model (``-00001-of-0000N``) being one choice of all its parts;
:func:`choose` picks one and :func:`gpu_fit` says whether it fits. No network here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ..errors import ChooseQuantisationError, RemoteNotFoundError
from ..gguf.modelfile import SPLIT_RE
from . import shortnames

log = logging.getLogger(__name__)

HF_HOSTS = frozenset({"huggingface.co", "www.huggingface.co", "hf.co"})

_QUANT_RE = re.compile(
    r"(?:^|[-_.])((?:UD-)?(?:I?Q[1-8](?:_[0-9A-Z]+)*|TQ[12]_0|MXFP4(?:_MOE)?|BF16|F16|F32))(?=$|[-_.])",
    re.IGNORECASE,
)
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# ---- sources -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubSource:
    repo_id: str  # "user/repo"
    filename: str | None = None  # a file in the repo ("sub/dir/x.gguf"); None: list the repo
    quant: str | None = None  # the quantisation asked for ("Q4_K_M")
    revision: str = "main"

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "")
        return text + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True)
class UrlSource:
    url: str

    def __str__(self) -> str:
        return self.url


Source = HubSource | UrlSource


def _hub_path_source(path: str, quant: str | None, revision: str = "main") -> HubSource:
    """``user/repo[/file.gguf][:QUANT]`` (no host)."""
    tail = None
    if ":" in path:
        path, tail = path.rsplit(":", 1)
        if not tail:
            raise ValueError(f"{path}: — nothing follows the ':'; give a quantisation, e.g. {path}:Q4_K_M")
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) < 2 or not all(_REPO_PART.match(p) for p in parts[:2]):
        raise ValueError(
            f"{path!r} is not a model source: give a Hugging Face repo (user/repo, user/repo:Q4_K_M, "
            "user/repo/file.gguf) or the http(s):// URL of a .gguf file"
        )
    filename = "/".join(parts[2:]) or None
    if filename is not None and not filename.lower().endswith(".gguf"):
        raise ValueError(f"{filename!r} is not a .gguf file: name a GGUF file of the repo, or just user/repo")
    if tail and quant and tail.upper() != quant.upper():
        raise ValueError(f"two quantisations asked for ({tail} and --quant {quant}): give one")
    return HubSource("/".join(parts[:2]), filename, tail or quant, revision)


def parse_source(text: str, quant: str | None = None) -> Source:
    """What the user typed as a Source. Raises ValueError (a sentence) for what cannot be one."""
    text = text.strip()
    quant = quant.strip() if quant else None
    if not text:
        raise ValueError("no source given: a Hugging Face repo (user/repo) or the URL of a .gguf file")
    lowered = text.lower()
    if lowered.startswith(("http://", "https://")):
        parts = urlsplit(text)
        host = (parts.hostname or "").lower()
        if host in HF_HOSTS:
            segments = [unquote(s) for s in parts.path.split("/") if s]
            if len(segments) >= 5 and segments[2] in ("resolve", "blob"):
                file = "/".join(segments[4:])
                return _hub_path_source(f"{segments[0]}/{segments[1]}/{file}", quant, segments[3])
            if len(segments) == 2:
                return _hub_path_source("/".join(segments), quant)
        if not parts.path.lower().endswith(".gguf"):
            raise ValueError(f"{text} does not name a .gguf file: give the URL of the GGUF file itself")
        if quant:
            raise ValueError("--quant applies to a Hugging Face repo, not to the URL of one file")
        return UrlSource(text)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if scheme and scheme.group(1).lower() != "hf":
        raise ValueError(
            f"{text!r} is not a model source: {scheme.group(1)}:// is not a scheme Timeshare gets files "
            "with; give an http(s):// URL of a .gguf file or a Hugging Face repo (user/repo)"
        )
    for prefix in ("hf.co/", "huggingface.co/", "www.huggingface.co/", "hf://"):
        if lowered.startswith(prefix):
            text = text[len(prefix) :]
            break
    if shortnames.is_short_name(text):  # llama3.2, qwen3:8b (Ollama's habit): from the table
        short = shortnames.resolve(text)
        return HubSource(short.repo_id, quant=quant or short.quant)
    return _hub_path_source(text, quant)


# ---- choices -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    name: str  # the path in the repo, or the URL's file name
    url: str  # the hub's resolve URL, or the URL itself
    size: int | None = None
    sha256: str | None = None  # the hub's LFS sha256, when it gives one
    validator: str | None = None  # a URL's ETag or Last-Modified (a partial file resumes only if it matches)


@dataclass(frozen=True)
class Choice:
    label: str  # the quantisation ("Q4_K_M"), else the file name
    files: tuple[RemoteFile, ...]  # one, or a split model's parts in order

    @property
    def filename(self) -> str:
        return self.files[0].name

    @property
    def size(self) -> int | None:
        sizes = [f.size for f in self.files]
        return sum(s for s in sizes if s is not None) if all(s is not None for s in sizes) else None


@dataclass(frozen=True)
class Listing:
    source: Source
    title: str  # "user/repo", or the URL
    choices: tuple[Choice, ...]
    licence: str = ""  # the repo card's licence (hub)
    revision: str = "main"
    gated: bool = False
    #: the repo's vision projectors (mmproj-*.gguf), which a model of it reads images with
    projectors: tuple[RemoteFile, ...] = ()


def quant_label(filename: str) -> str:
    """The quantisation a file name carries ("Q4_K_M", "IQ4_XS", "F16", "UD-Q4_K_XL"), else ""."""
    name = filename.rsplit("/", 1)[-1]
    m = SPLIT_RE.match(name)
    stem = m.group("stem") if m else re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    found = list(_QUANT_RE.finditer(stem))
    return found[-1].group(1).upper() if found else ""


def group_choices(files: list[RemoteFile]) -> tuple[Choice, ...]:
    """GGUF files as choices: one per file, a split model's parts (complete sets only) as one;
    vision projectors (mmproj) left out; sorted by size."""
    singles: list[tuple[RemoteFile, ...]] = []
    splits: dict[tuple[str, int], dict[int, RemoteFile]] = {}
    for f in files:
        base = f.name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or "mmproj" in base.lower():
            continue
        m = SPLIT_RE.match(f.name)
        if m:
            splits.setdefault((m.group("stem"), int(m.group("total"))), {})[int(m.group("part"))] = f
        else:
            singles.append((f,))
    groups = list(singles)
    for (stem, total), parts in splits.items():
        if sorted(parts) == list(range(1, total + 1)):
            groups.append(tuple(parts[i] for i in range(1, total + 1)))
        else:
            log.info("skipping %s: parts %s of %d only", stem, sorted(parts), total)
    labels = [quant_label(g[0].name) for g in groups]
    choices = []
    for group, label in zip(groups, labels, strict=True):
        if not label or labels.count(label) > 1:
            m = SPLIT_RE.match(group[0].name)
            label = m.group("stem") if m else group[0].name
            label = re.sub(r"\.gguf$", "", label, flags=re.IGNORECASE)
        choices.append(Choice(label, group))
    return tuple(sorted(choices, key=lambda c: (c.size is None, c.size or 0, c.label)))


def is_projector_name(filename: str) -> bool:
    """A vision projector's file name (``mmproj-model-f16.gguf``, ``gemma-3-4b-mmproj-F16.gguf``)."""
    base = filename.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and "mmproj" in base


#: a repo's projectors, most wanted first: F16 (llama.cpp's converters' default), BF16, Q8_0, F32
_PROJECTOR_PREFERENCE = ("F16", "BF16", "Q8_0", "F32")


def projector_choice(listing: Listing) -> Choice | None:
    """The projector to fetch beside a model of ``listing`` (None: the repo has none): F16 when
    there is one, then BF16, Q8_0, F32, else the smallest."""
    if not listing.projectors:
        return None

    def rank(f: RemoteFile) -> tuple[int, int, str]:
        label = quant_label(f.name)
        pref = (
            _PROJECTOR_PREFERENCE.index(label)
            if label in _PROJECTOR_PREFERENCE
            else len(_PROJECTOR_PREFERENCE)
        )
        return pref, f.size if f.size is not None else 1 << 62, f.name

    best = min(listing.projectors, key=rank)
    return Choice(quant_label(best.name) or "mmproj", (best,))


def choose(listing: Listing, quant: str | None = None) -> Choice:
    """The choice asked for (``quant``, else the source's file or quantisation), or the only one.

    Raises RemoteNotFoundError when nothing matches and ChooseQuantisationError when several do."""
    src = listing.source
    wanted = quant or (src.quant if isinstance(src, HubSource) else None)
    choices = listing.choices
    if not choices:
        raise RemoteNotFoundError(f"{listing.title} has no GGUF model file: pick a repo that offers GGUFs")
    labels = tuple(c.label for c in choices)
    if wanted:
        key = wanted.upper().removesuffix(".GGUF")
        hits = [c for c in choices if c.label.upper() == key]
        hits = hits or [
            c for c in choices if c.filename.rsplit("/", 1)[-1].upper().removesuffix(".GGUF") == key
        ]
        if len(hits) == 1:
            return hits[0]
        raise RemoteNotFoundError(
            f"{listing.title} has no quantisation {wanted}; it has: {', '.join(labels)}"
        )
    if len(choices) == 1:
        return choices[0]
    raise ChooseQuantisationError(
        f"{listing.title} has {len(choices)} quantisations: pick one with --quant "
        f"(or {listing.title}:QUANT): {', '.join(labels)}",
        labels,
    )


# ---- fit ------------------------------------------------------------------------------------


def gpu_fit(size: int | None, vram_budget: int | None, kv_bytes: int | None = None) -> str:
    """Whether a model of ``size`` bytes fits a GPU budget, in words ("fits", "too big", "unknown").

    The weights need their size in device memory, a tenth more for the compute buffers, and the KV
    cache: ``kv_bytes`` (``gguf.kvcache``; None: not known, the weights alone are compared). Without
    a budget (nothing measures the device memory yet) it is "unknown".
    """
    if size is None or vram_budget is None or vram_budget <= 0:
        return "unknown"
    return "fits" if size * 1.1 + (kv_bytes or 0) <= vram_budget else "too big"
