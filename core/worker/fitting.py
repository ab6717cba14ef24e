"""A model fitted to its device before it loads (core/config/fit.py's rule, with this machine's
numbers): the settings left unset (``n_ctx``, ``parallel`` = 0, ``n_gpu_layers`` = -1 when the
weights do not fit) chosen from the device's free memory and the GGUF's header, and the KV cache
type resolved (``models[].kv_cache_type`` or ``arena.kv_cache_type``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ..config.fit import Fit, FitInput, LoadPlan, fit_model
from ..config.schema import KvCacheType, ModelConfig
from ..gguf.catalog import read_gguf_header_values
from ..gguf.kvcache import KvShape, kv_shape
from ..residency import check_gguf
from .device import DeviceMemory, device_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fitted:
    model: ModelConfig  # with n_ctx, parallel, n_gpu_layers and kv_cache_type as the worker loads it
    fit: Fit
    plan: LoadPlan
    kv_shape: KvShape | None  # None: the cache is not plain K/V (recurrent, MLA) or not known


def fit_to_device(
    model: ModelConfig, default_kv_type: KvCacheType, device: DeviceMemory, shared: int | None = None
) -> Fitted:
    """``model`` fitted to ``device``: to ``shared``, the budget it time-shares (an auto budget:
    core/arena/budget.time_share_room), else to the device's free bytes now. Raises ModelFileError
    for a file whose header cannot be read, OutOfDeviceMemoryError when the model cannot fit even
    at its smallest."""
    kv_type = model.kv_type(default_kv_type)
    # the file's own checks first, with their words (the path, truncation): as Engine.load's
    check_gguf(model.path)
    values, weight_bytes = read_gguf_header_values(model.path)
    arch = values.get("general.architecture")
    layers = values.get(f"{arch}.block_count") if isinstance(arch, str) else None
    trained = values.get(f"{arch}.context_length") if isinstance(arch, str) else None
    shape = kv_shape(values)
    known = shape if isinstance(shape, KvShape) else None
    if known is None:
        log.info("%s: no KV estimate (%s): n_ctx and parallel are not fitted to the memory", model.id, shape)
    fit = fit_model(
        FitInput(
            free=device.free,
            shared=-1 if shared is None else shared,
            gpu=device.gpu,
            weight_bytes=weight_bytes,
            layers=layers if isinstance(layers, int) and not isinstance(layers, bool) else 0,
            kv_token_bytes=known.token_bytes(kv_type) if known is not None else 0,
            trained_ctx=trained if isinstance(trained, int) and not isinstance(trained, bool) else 0,
            n_ctx=model.n_ctx,
            parallel=model.parallel,
            n_gpu_layers=model.n_gpu_layers,
            model=model.id,
            kv_cache_type=kv_type,
        )
    )
    if fit.note:
        where = (
            f"a time-shared budget of {shared} bytes" if shared is not None else f"{device.free} bytes free"
        )
        log.info("%s fitted to %s (%s): %s", model.id, device.name, where, fit.note)
    fitted = replace(
        model, n_ctx=fit.n_ctx, parallel=fit.parallel, n_gpu_layers=fit.n_gpu_layers, kv_cache_type=kv_type
    )

    def free_now() -> int | None:
        try:
            return device_memory(device.index).free
        except Exception:  # a measurement for an error's words only
            return None

    plan = LoadPlan(device.gpu, fit.kv_bytes, weight_bytes, free_now)
    return Fitted(fitted, fit, plan, known)
