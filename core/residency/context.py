"""A Llama's context and model while residency has them out: the stand-in that makes any use of
them an error, a new context with a KV snapshot put back, the tokenizer's own model reference.
Shared by the in-place path's KV level and the rebuild path."""

from __future__ import annotations

from typing import Any, NoReturn

import llama_cpp

from .. import envvars
from ..errors import OutOfDeviceMemoryError, ResidencyError
from . import computebuf
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


class ContextAside:
    """The Llama's context object while the weights are released and the KV cache stays in it:
    set aside, a :class:`Released` stand-in in its place (nothing may decode), until a restore
    puts it back. The Residency (the loop thread) is its only caller."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._ctx: Any = None  # the context object set aside (None: the Llama holds its own)

    @property
    def held(self) -> bool:
        return self._ctx is not None

    def current(self) -> Any:
        """The context object: the one set aside, else the Llama's."""
        return self._ctx if self._ctx is not None else self._llm._ctx

    def set_aside(self) -> None:
        self._ctx = self._llm._ctx
        self._llm._ctx = Released("context")

    def handed_on(self) -> None:
        """The context object (:meth:`current`) was handed on (the KV level keeps or freed it):
        the Llama holds the stand-in."""
        self._ctx = None
        self._llm._ctx = Released("context")

    def put_back(self, forget: bool = False) -> None:
        """The context set aside back into the Llama; ``forget``: its graphs are built anew at the
        next decode (:func:`forget_moved`: a weight buffer came back at another address)."""
        if forget:
            forget_moved(self._ctx.ctx, self._llm)
        self._llm._ctx = self._ctx
        self._ctx = None

    def close(self) -> None:
        """The Residency is closed: the Llama is no longer its (a context set aside stays here)."""
        self._llm = None

    def live(self) -> int:
        """The llama_context handle the Llama computes in now (0: none, released, or closed)."""
        try:
            ctx = self._llm._ctx.ctx
        except (AttributeError, ResidencyError):
            return 0
        return int(ctx or 0)


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


def forget_graphs(ctx: Any, llm: Any) -> None:
    """Make the context build its compute graphs anew at the next decode.

    llama.cpp reuses the previous decode's graph when the batch has the same shape, and then
    ggml-cuda replays its captured CUDA graph without comparing the tensors' data pointers --
    which still point at the weights' old addresses after an in-place restore (an illegal memory
    access on the H200 whenever cudaMalloc did not hand back the same address). Clearing the
    control vector (none is set: Llama has no API for one) is the public call that marks the
    scheduler for a new reserve, so the next decode gets fresh graphs and CUDA graphs re-capture.

    Never needed on Vulkan, and never called there: a Vulkan buffer's base is the constant
    ``vk_ptr_base``, so its tensors' data pointers never move (restore reports ``moved`` False);
    ggml-vulkan finds the VkBuffer through the buffer's context at every dispatch and drops its
    cached descriptor bindings whenever any VkBuffer is destroyed. It would also crash there:
    re-creating the scheduler mid-context (this very call, even with no release at all) makes the
    next decode segfault in ggml-vulkan 0.3.36 on lavapipe for a model with a CPU split
    (Gemma-3-270M, whose output matrix stays on the CPU); docs/lab/HISTORY.md, Vulkan.
    """
    n_embd = int(llama_cpp.llama_model_n_embd(llm._model.model))
    rc = int(llama_cpp.llama_set_adapter_cvec(ctx, None, 0, n_embd, -1, -1))
    if rc != 0:
        raise ResidencyError(
            f"could not reset the context's graphs after restore (llama_set_adapter_cvec returned {rc})"
        )


def forget_moved(ctx: Any, llm: Any) -> None:
    """A weight buffer came back at another address: the next decode of ``ctx`` must not replay
    a graph that holds the old one. llama.cpp reuses its previous graph only while it is the
    active one (``gf_res_prev_active``) and may be reused; ggml-cuda replays a captured CUDA graph
    without comparing data pointers only for a graph whose splits' uids it has seen. So dropping
    the previous graph (computebuf.forget_graph) is enough: the next decode builds and allocates
    a new one, the scheduler gives its splits new uids, and ggml-cuda compares every node's
    sources' data pointers and updates its captured graph. The scheduler's plan (its compute
    buffers' sizes) does not depend on where the weights are: no reserve (20-25 ms on an H100,
    with a device-wide wait). ``TIMESHARE_GRAPH_RESET=reserve`` (or a build that cannot drop the
    previous graph): :func:`forget_graphs`, the reserve, as before.

    Never called on Vulkan (its buffers never move: see forget_graphs)."""
    if envvars.GRAPH_RESET.text().strip().lower() != "reserve":
        try:
            computebuf.forget_graph(int(ctx))
            return
        except ResidencyError:  # this build does not export what it needs
            pass
    forget_graphs(ctx, llm)
