"""Fitting a model to the memory it is given (issue 39, item 3): the unset ``parallel`` and
``n_ctx``, and the GPU layers when the weights alone do not fit. Plain numbers, no llama objects:
the worker calls :func:`fit_model` with its device's free bytes before it loads, tests call it
with any device size.

The rule (docs: README, *Fitting the card*):

1. *Room*: under an auto VRAM budget, the budget the model time-shares: the arena's budget (the
   device's memory less what other programs used at the first worker's start and the margin) less
   what the other models keep there at the deepest level they can reach (a parked model's floor:
   its driver context; a pinned model's weights and whole reserve) and, on a GPU, this worker's own
   driver context (:func:`..arena.budget.time_share_room`). Not the memory free at the load: a
   model parked at the weights level still holds its KV cache then, and goes deep when the new
   model needs the room (the load asks for it first). Without an arena budget (one-model, a size,
   a share), the device's free bytes when the worker loads (the memory Timeshare may use; on a
   CPU build, host memory), less the auto budget's margin (:func:`..arena.budget.auto_margin`:
   5 %, at least 256 MiB).
2. *Start*: ``parallel`` as set, or auto (4 on a GPU build, 1 on a CPU one: config.parallel);
   ``n_ctx`` as set, or the model's trained context capped at :data:`AUTO_N_CTX_GPU` (4096) on a
   GPU build and :data:`AUTO_N_CTX_CPU` (2048) on a CPU one.
3. *KV share*: when ``parallel`` or ``n_ctx`` is auto, the KV cache (K and V of the configured
   ``kv_cache_type``, for ``n_ctx × parallel`` cells) may take at most 1/:data:`KV_SHARE` of the
   room, because a parked model keeps its KV on the device while the others' weights take turns:
   ``parallel`` halves first (4 → 2 → 1), then ``n_ctx`` halves down to :data:`MIN_AUTO_N_CTX`
   (or the trained context, when shorter). Settings given are kept.
4. *GPU layers*: on a GPU build with ``n_gpu_layers = -1`` (all), when the weights, their compute
   allowance (a tenth of them) and the KV do not fit the room, only the layers that do are put on
   the GPU (the rest run on the CPU; the GPU part is what time-shares).
5. A model whose KV alone, or KV and one layer, exceeds the room fails with the numbers and the
   settings to change (:class:`~..errors.OutOfDeviceMemoryError`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..arena.budget import auto_margin
from ..errors import OutOfDeviceMemoryError
from ..util.units import decimal_bytes
from .parallel import auto_parallel

#: ``n_ctx`` when unset: the trained context, capped at this (Ollama's default context, and what
#: the catalog proposes for a new entry), on a build with a GPU ...
AUTO_N_CTX_GPU = 4096
#: ... and on a CPU-only build (the setting's default before it could be left unset)
AUTO_N_CTX_CPU = 2048
#: an auto ``n_ctx`` is never halved below this (nor above the trained context)
MIN_AUTO_N_CTX = 512
#: an auto-fitted model's KV cache takes at most 1/KV_SHARE of the room: two 8B Q4 models on an
#: 8 GB card keep their KV (≈ 0.5 GB each at 4096 tokens, f16) beside one model's weights
KV_SHARE = 8
#: the compute buffers' allowance beside the weights (as the "Get model" dialog estimates them)
COMPUTE_SHARE = 10


@dataclass(frozen=True)
class FitInput:
    """What the rule is given: the device and the model, as plain numbers."""

    free: int  # bytes Timeshare may use on the device (free at the worker's start)
    gpu: bool  # a GPU build (False: host memory plays the device)
    weight_bytes: int  # the model's weights (the GGUF's tensor bytes)
    layers: int  # the model's layers (block_count); 0: unknown
    kv_token_bytes: int  # K and V of one cell over all layers at the configured type; 0: unknown
    trained_ctx: int = 0  # the model's trained context; 0: unknown
    n_ctx: int = 0  # models[].n_ctx (0: auto)
    parallel: int = 0  # models[].parallel (0: auto)
    n_gpu_layers: int = -1  # models[].n_gpu_layers (-1: all)
    model: str = "the model"  # for the error's sentence
    kv_cache_type: str = "f16"
    #: the budget the model time-shares (rule 1: auto budgets); -1: none, the room is ``free``
    #: less the margin
    shared: int = -1


@dataclass(frozen=True)
class Fit:
    """The settings the worker loads with, and what the rule did."""

    n_ctx: int
    parallel: int
    n_gpu_layers: int
    kv_bytes: int  # the KV cache (all layers' cells; on the device for the offloaded layers)
    room: int  # the budget it time-shares, or free less the margin
    note: str = ""  # what was chosen and why ("" when every setting was given)
    #: what the model asks of the room once loaded: its weights on the device (the offloaded
    #: layers' share), their compute allowance and its KV cache
    need: int = 0


@dataclass(frozen=True)
class LoadPlan:
    """What a worker asked of its device for a load, for the words of a failure."""

    gpu: bool
    kv_bytes: int  # the KV cache the fit counted
    weight_bytes: int  # the weights the fit counted (on the device)
    free_now: Callable[[], int | None]  # the device's free bytes now (None: not known); never raises


def memory_words(gpu: bool) -> str:
    """What the device's memory is called: "GPU memory", or "memory" on a CPU-only build."""
    return "GPU memory" if gpu else "memory"


def auto_n_ctx(trained_ctx: int, gpu: bool) -> int:
    """``n_ctx`` when unset, before the KV share: the trained context capped at 4096 (GPU) or
    2048 (CPU); the cap alone when the trained context is unknown."""
    cap = AUTO_N_CTX_GPU if gpu else AUTO_N_CTX_CPU
    return min(trained_ctx, cap) if trained_ctx > 0 else cap


def _kv(x: FitInput, n_ctx: int, parallel: int) -> int:
    # cells as llama.cpp pads them (gguf.kvcache.padded_cells): 256 at a time
    total = -(-(n_ctx * parallel) // 256) * 256
    return x.kv_token_bytes * (total // parallel * parallel)


def fit_model(x: FitInput) -> Fit:
    """The rule of this module's docstring. Raises OutOfDeviceMemoryError when the model cannot
    fit even at its smallest."""
    shared = x.shared >= 0
    room = x.shared if shared else max(0, x.free - auto_margin(x.free))
    # the words for where the room comes from
    of_room = (
        f"the {decimal_bytes(room)} budget it time-shares"
        if shared
        else f"the {decimal_bytes(room)} Timeshare may use"
    )
    auto_par = x.parallel <= 0
    auto_ctx = x.n_ctx <= 0
    parallel = x.parallel if not auto_par else auto_parallel(x.gpu)
    n_ctx = x.n_ctx if not auto_ctx else auto_n_ctx(x.trained_ctx, x.gpu)
    floor = min(MIN_AUTO_N_CTX, x.trained_ctx) if x.trained_ctx > 0 else MIN_AUTO_N_CTX
    limit = room // KV_SHARE if (auto_par or auto_ctx) else room
    while x.kv_token_bytes and _kv(x, n_ctx, parallel) > limit:
        if auto_par and parallel > 1:
            parallel //= 2
        elif auto_ctx and n_ctx > floor:
            n_ctx = max(floor, n_ctx // 2)
        else:
            break
    kv = _kv(x, n_ctx, parallel)
    where = "on the GPU" if x.gpu else "in memory"
    words = memory_words(x.gpu)
    change = 'lower models[].n_ctx or parallel, set kv_cache_type = "q8_0" or "q4_0"'
    if kv > room:
        raise OutOfDeviceMemoryError(
            f"out of {words}: {x.model}'s KV cache needs {decimal_bytes(kv)} (n_ctx {n_ctx} × "
            f"{parallel} sequences, {x.kv_cache_type}) and {decimal_bytes(room)} of {words} is free "
            f"{where} for Timeshare ({_source(x)}): {change}"
        )
    n_gpu_layers = x.n_gpu_layers
    notes = []
    if auto_par or auto_ctx:
        chosen = ", ".join(
            part for part, auto in ((f"parallel {parallel}", auto_par), (f"n_ctx {n_ctx}", auto_ctx)) if auto
        )
        notes.append(
            f"{chosen} (auto: KV {decimal_bytes(kv)} ≤ 1/{KV_SHARE} of {of_room})"
            if kv <= limit
            else f"{chosen} (auto, at its smallest: KV {decimal_bytes(kv)})"
        )
    compute = x.weight_bytes // COMPUTE_SHARE
    if x.gpu and x.n_gpu_layers < 0 and x.layers > 0 and x.weight_bytes + compute + kv > room:
        per_layer = (x.weight_bytes + compute) / (x.layers + 1)  # the output layer is one more
        fits = int((room - kv) // per_layer) - 1 if room > kv else -1
        if fits < 1:
            raise OutOfDeviceMemoryError(
                f"out of {words}: {x.model} cannot put even one layer ({decimal_bytes(int(per_layer))}) "
                f"beside its KV cache of {decimal_bytes(kv)} in the {decimal_bytes(room)} of {words} free "
                f"for Timeshare ({_source(x)}): {change}, or set n_gpu_layers = 0 (CPU only)"
            )
        n_gpu_layers = min(fits, x.layers)
        notes.append(
            f"n_gpu_layers {n_gpu_layers} of {x.layers} (auto: the weights, "
            f"{decimal_bytes(x.weight_bytes)}, do not all fit {of_room}; the rest run on the CPU)"
        )
    return Fit(n_ctx, parallel, n_gpu_layers, kv, room, "; ".join(notes), _need(x, n_gpu_layers, kv))


def _source(x: FitInput) -> str:
    if x.shared >= 0:
        return "the auto VRAM budget it time-shares, less what the other models keep at their deepest level"
    return f"{decimal_bytes(x.free)} free, less the margin"


def _need(x: FitInput, n_gpu_layers: int, kv: int) -> int:
    """The bytes a fitted model asks of its room: weights (the offloaded layers' share on a GPU),
    their compute allowance, and the KV cache."""
    weights = x.weight_bytes + x.weight_bytes // COMPUTE_SHARE
    if x.gpu and x.layers > 0 and 0 <= n_gpu_layers < x.layers:
        weights = int(weights * (n_gpu_layers + 1) / (x.layers + 1))
    return weights + kv
