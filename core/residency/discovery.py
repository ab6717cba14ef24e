"""The in-place path's first step: find the weight tensors. A throwaway context with ``cb_eval``
runs one warm-up decode; every ``src`` of a graph node whose buffer is used for WEIGHTS is a
weight tensor (views lead to their ``view_src``). Where overlapped restores may be used, the same
context also finds and checks where an eval hook goes in a live context (residency/evalhook.py)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp

from . import _ggml, evalhook
from .unsupported import InPlaceUnsupportedError


class Discovery:
    """Collects weight tensors from the ask phase of cb_eval (runs on the decoding thread)."""

    def __init__(self, layout: _ggml.TensorLayout) -> None:
        self.layout = layout
        self.weights: set[int] = set()
        #: graph nodes' sources that were views of a weight (a reused graph keeps their
        #: ``buffer``/``data`` from when it was built)
        self.weight_views = 0
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self.observe)
        #: names of the weights the warm-up graph did not show, found in the model's tensor
        #: lists (:func:`complete_from_tensor_lists`)
        self.listed: list[str] = []
        #: where an eval hook goes in a live context (overlapped restores); None: not usable,
        #: ``hook_note`` says why
        self.hook: evalhook.HookLayout | None = None
        self.hook_note = "not probed"

    def is_weight_buffer(self, buf: int) -> bool:
        return bool(buf) and int(_ggml.buffer_get_usage(buf)) == _ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS

    def observe(self, tensor: int | None, ask: bool, _user: int | None) -> bool:
        """cb_eval: note the weights among the sources of the node asked about (never asks to
        see its data)."""
        if not ask or not tensor:
            return True
        lay = self.layout
        for i in range(_ggml.GGML_MAX_SRC):
            src = _ggml.read_ptr(tensor + lay.src + 8 * i)
            if not src:
                continue
            root = _ggml.view_root(src, lay)  # a view of a weight leads to the weight
            if self.is_weight_buffer(_ggml.read_ptr(root + lay.buffer)):
                self.weights.add(root)
                if root != src:
                    self.weight_views += 1
        return False  # observe only: the whole split runs at once


def discover(llm: Any, layout: _ggml.TensorLayout, probe_hook: bool = False) -> Discovery:
    """One warm-up decode of one token in a throwaway context that has the callback (``llm``: a
    ``llama_cpp.Llama``, untyped). ``probe_hook``: then find and check, in that context, where an
    eval hook goes in a live context (residency/evalhook.py; a few more one- and two-token
    decodes)."""
    disc = Discovery(layout)
    src_params = llm.context_params
    params = llama_cpp.llama_context_params()
    ctypes.memmove(ctypes.addressof(params), ctypes.addressof(src_params), ctypes.sizeof(params))
    params.n_ctx = 256
    params.n_batch = 32
    params.n_ubatch = 32
    params.n_seq_max = 1
    params.embeddings = False
    params.cb_eval = disc.callback
    marker = ctypes.c_char(b"d")  # a user-data pointer the hook probe looks for
    params.cb_eval_user_data = ctypes.c_void_p(ctypes.addressof(marker))
    model = llm._model.model
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise InPlaceUnsupportedError("could not create the warm-up context for weight discovery")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        token = int(llama_cpp.llama_vocab_bos(vocab))
        if token < 0:
            token = 0

        def decode(n: int) -> None:
            tokens = (llama_cpp.llama_token * n)(*([token] * n))
            rc = int(llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, n)))
            if rc != 0:
                raise InPlaceUnsupportedError(
                    f"the warm-up decode for weight discovery failed (llama_decode returned {rc})"
                )

        decode(1)
        if probe_hook:
            n_embd = int(llama_cpp.llama_model_n_embd(model))

            def reset_graphs() -> None:  # what Residency does when buffers moved
                llama_cpp.llama_set_adapter_cvec(ctx, None, 0, n_embd, -1, -1)

            try:
                cb = int(ctypes.cast(disc.callback, ctypes.c_void_p).value or 0)
                hook = evalhook.find_layout(int(ctx), cb, ctypes.addressof(marker))
                evalhook.verify(int(ctx), hook, decode, reset_graphs)
                disc.hook, disc.hook_note = hook, ""
            except evalhook.HookUnavailableError as exc:
                disc.hook_note = str(exc)
    finally:
        llama_cpp.llama_free(ctx)
    if not disc.weights:
        raise InPlaceUnsupportedError("the warm-up decode showed no weight tensors")
    complete_from_tensor_lists(disc)
    return disc


def complete_from_tensor_lists(disc: Discovery) -> list[str]:
    """Add the weight tensors the warm-up graph did not show (a weight only some inputs use: a
    classifier head, a multi-token-prediction layer), found by walking each ggml context of the
    model's tensors forward from the weights the graph showed (the model creates each buffer
    type's tensors in one context; residency/_ggml.next_tensor); a weight created before every
    one the graph showed in its context stays unseen (the plan's completeness check refuses the
    buffer then). Returns the names added (also in ``disc.listed``)."""
    lay = disc.layout
    seen = set(disc.weights)
    added: list[str] = []
    for start in sorted(disc.weights):
        t = _ggml.next_tensor(start, lay)
        while t and t not in seen:
            seen.add(t)
            is_view = bool(_ggml.read_ptr(t + lay.view_src))
            if not is_view and disc.is_weight_buffer(_ggml.read_ptr(t + lay.buffer)):
                disc.weights.add(t)
                added.append(_ggml.tensor_name(t))
            t = _ggml.next_tensor(t, lay)
    disc.listed.extend(added)
    return added
