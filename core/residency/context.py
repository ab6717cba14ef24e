"""A Llama's context and model while residency has them out: the stand-in that makes any use of
them an error, a new context with a KV snapshot put back, the tokenizer's own model reference.
Shared by the in-place path's KV level and the rebuild path."""

from __future__ import annotations

from typing import Any, NoReturn

from ..errors import OutOfDeviceMemoryError, ResidencyError
from .kv import KvSnapshot


class Released:
    """Stands in for a Llama's context (or model) while it is released: any use is an error, so
    nothing can decode on freed weights."""

    def __init__(self, what: str) -> None:
        object.__setattr__(self, "_what", what)

    def __getattr__(self, name: str) -> NoReturn:
        raise ResidencyError(
            f"the model's {object.__getattribute__(self, '_what')} is released: "
            "call Residency.restore() before using it"
        )

    def __bool__(self) -> bool:
        return True


def new_context(llm: Any, model: Any, kv: KvSnapshot | None, model_path: str, *, stays_released: str) -> Any:
    """A new llama context on ``model`` with ``llm``'s context parameters and the KV snapshot
    ``kv`` (if any) applied, then closed: the caller drops it. Out of memory:
    OutOfDeviceMemoryError (``stays_released`` goes into its message); a snapshot that does not
    apply: ResidencyError, the snapshot kept."""
    from llama_cpp import _internals

    try:
        ctx: Any = _internals.LlamaContext(model=model, params=llm.context_params, verbose=llm.verbose)
    except ValueError as exc:
        raise OutOfDeviceMemoryError(
            f"cannot create the context of {model_path} again ({exc}): {stays_released}"
            "free device memory and try again"
        ) from exc
    if kv is not None:
        try:
            kv.apply(ctx.ctx)
        except ResidencyError:
            ctx.close()
            raise
        kv.close()
    return ctx


def point_tokenizer(llm: Any, model: Any) -> None:
    """llama-cpp-python's tokenizer keeps its own reference to the model object."""
    tok = getattr(llm, "tokenizer_", None)
    if tok is not None and hasattr(tok, "_model"):
        tok._model = model
