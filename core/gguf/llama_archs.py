"""Which model architectures the installed llama.cpp can load.

llama.cpp refuses a GGUF whose ``general.architecture`` is not in its table of architecture names
(``LLM_ARCH_NAMES`` in src/llama-arch.cpp: "unknown model architecture"). That table is compiled
into libllama, and the build exports ``const char *llm_arch_name(llm_arch)``: calling it for
0, 1, 2, ... until it answers "(unknown)" lists exactly the names this build accepts. It is not in
llama.h, so it is reached by its C++ (Itanium ABI) symbol name, which Linux and macOS builds share.

The list is read in a short-lived subprocess (``python -m timeshare.core.gguf.llama_archs``) so that the
tray app never loads llama.cpp's libraries itself, and cached on disk per library file (path, size,
modification time). Where the symbol is missing (another ABI, a future build that hides it), the
architectures of the installed ``gguf`` package (llama.cpp's own Python package) stand in, and the
answer says so: ``ArchSupport.exact`` is False.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import envvars, paths
from ..util.atomic import atomic_write_text

log = logging.getLogger(__name__)

#: ``const char * llm_arch_name(llm_arch arch)``, Itanium C++ ABI mangling
ARCH_NAME_SYMBOL = "_Z13llm_arch_name8llm_arch"
#: architectures that are not language models (llama.cpp has names for them, Timeshare cannot chat
#: with them): vision projectors
NOT_LANGUAGE_MODELS = frozenset({"clip"})
_MAX_ARCHS = 4096
_LIB_NAMES = ("libllama.so", "libllama.dylib", "llama.dll")


@dataclass(frozen=True)
class ArchSupport:
    names: frozenset[str]  # the architectures the installed llama.cpp loads
    exact: bool  # True: read from the library itself; False: the gguf package's table stands in
    source: str  # where the list came from, for messages and the log

    #: the list of a vision projector's download (issue 41): "clip" alone
    projector: bool = False

    def supports(self, architecture: str) -> bool:
        if self.projector:
            return architecture in NOT_LANGUAGE_MODELS
        return architecture in self.names and architecture not in NOT_LANGUAGE_MODELS


#: what a vision projector (mmproj) downloaded beside its model may be
PROJECTORS = ArchSupport(NOT_LANGUAGE_MODELS, True, "vision projectors", projector=True)


def llama_library() -> Path | None:
    """The libllama of the installed llama-cpp-python (found without importing it), or None."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib_dir = Path(spec.origin).parent / "lib"
    return next((lib_dir / n for n in _LIB_NAMES if (lib_dir / n).exists()), None)


def read_names_from_library(lib: Path) -> list[str]:
    """Call ``llm_arch_name`` in ``lib`` for every enum value (loads the library: run it in a
    subprocess). Raises OSError when the library or the symbol cannot be used."""
    import ctypes

    handle = ctypes.CDLL(str(lib))
    try:
        func = getattr(handle, ARCH_NAME_SYMBOL)
    except AttributeError as exc:
        raise OSError(f"{lib.name} does not export {ARCH_NAME_SYMBOL}") from exc
    func.restype = ctypes.c_char_p
    func.argtypes = [ctypes.c_int]
    names: list[str] = []
    for i in range(_MAX_ARCHS):
        raw = func(i)
        name = raw.decode("utf-8", "replace") if raw else ""
        if name in ("(unknown)", "unknown", ""):
            break
        names.append(name)
    if not names:
        raise OSError(f"{lib.name}: {ARCH_NAME_SYMBOL} named no architecture")
    return names


def _gguf_table() -> ArchSupport:
    from gguf.constants import MODEL_ARCH_NAMES

    names = frozenset(str(n) for n in MODEL_ARCH_NAMES.values())
    return ArchSupport(names, exact=False, source="the gguf package's architecture table")


def _cache_key(lib: Path) -> str:
    st = lib.stat()
    return f"{lib.resolve()}:{st.st_size}:{st.st_mtime_ns}"


@functools.lru_cache(maxsize=4)
def _from_library(key: str, lib: str) -> ArchSupport | None:
    cache = paths.cache_dir() / "llama-archs.json"
    try:
        record = json.loads(cache.read_text())
        if record.get("key") == key and isinstance(record.get("names"), list):
            return ArchSupport(frozenset(map(str, record["names"])), exact=True, source=lib)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        done = subprocess.run(
            [sys.executable, "-m", "timeshare.core.gguf.llama_archs", lib],
            capture_output=True,
            text=True,
            timeout=60,
            env=envvars.environment(GGML_BACKEND_SILENT="1"),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cannot list llama.cpp's architectures: %s", exc)
        return None
    if done.returncode != 0:
        log.warning("cannot list llama.cpp's architectures: %s", done.stderr.strip()[-500:])
        return None
    try:
        names = [str(n) for n in json.loads(done.stdout)]
    except ValueError:
        log.warning("cannot list llama.cpp's architectures: unreadable answer %r", done.stdout[:200])
        return None
    try:
        atomic_write_text(cache, json.dumps({"key": key, "names": names}) + "\n", backup=False, mode=0o644)
    except OSError as exc:
        log.debug("not caching the architecture list: %s", exc)
    return ArchSupport(frozenset(names), exact=True, source=lib)


def supported_architectures() -> ArchSupport:
    """The architectures the installed llama.cpp can load (see the module's docstring)."""
    lib = llama_library()
    if lib is not None:
        found = _from_library(_cache_key(lib), str(lib))
        if found is not None:
            return found
    else:
        log.warning("llama-cpp-python's library was not found: using the gguf package's table")
    return _gguf_table()


def main(argv: list[str] | None = None) -> int:
    """``python -m timeshare.core.gguf.llama_archs LIB``: print the names as a JSON list."""
    args = sys.argv[1:] if argv is None else argv
    lib = Path(args[0]) if args else llama_library()
    if lib is None:
        print("llama-cpp-python's library was not found", file=sys.stderr)
        return 1
    try:
        names = read_names_from_library(lib)
    except OSError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(json.dumps(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
