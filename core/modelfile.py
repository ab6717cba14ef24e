"""The cheap check of a model file that every room does before anything expensive.

It reads four bytes, never numpy or llama.cpp, so the pool, the engine and the benchmarks can
call it anywhere. The full check (header, truncated tensor data) is ``residency.check_gguf``,
done by the worker when it loads the file; the config layer words its own field-path messages.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"


def gguf_problem(path: str) -> str:
    """Why ``path`` cannot be a GGUF model, as a sentence that says what to do; "" when it can."""
    p = Path(path).expanduser()
    if not p.exists():
        return f"model file {p} does not exist: check the path, which must name a .gguf file"
    if not p.is_file():
        return f"model path {p} is not a file: point it at a .gguf file"
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"model file {p} cannot be read ({exc.strerror}): check its permissions"
    if magic != GGUF_MAGIC:
        return f"model file {p} is not a GGUF file (it does not start with 'GGUF'): choose a .gguf model file"
    return ""


def check_model_file(path: str) -> None:
    """Fail early and clearly on a model file that is missing or not a GGUF at all."""
    problem = gguf_problem(path)
    if problem:
        raise ModelFileError(problem)
