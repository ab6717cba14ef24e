"""The rebuild path, the portable fallback: a release snapshots the KV cache into host memory and
frees the context and the model; a restore loads the model from its file again (after checking it
is still the same file), makes a new context and puts the KV cache back. Slower than in place,
but it works on any backend and any llama-cpp-python version."""

from __future__ import annotations

import contextlib
from typing import Any

import llama_cpp

from ..errors import ModelFileChangedError, OutOfDeviceMemoryError
from ..util.fileid import FileId
from .context import Released, new_context, point_tokenizer
from .kv import KvSnapshot
from .kvmemory import KvHostMemory
from .kvupload import KvUpload
from .paths import PathName, WeightPart
from .state import Weights
from .timeline import ReleaseSteps, RestoreSteps


class RebuildPath:
    """Frees and rebuilds ``llm``'s model and context in place (the same ``llm`` object works
    again after :meth:`restore`); a :class:`~.paths.ResidencyPath` of one part, ``weight_bytes``
    (the model's size) over ``n_layer`` layers. The loop thread's :class:`Residency` is its only
    caller."""

    name: PathName = "rebuild"
    frees_memory = True
    releases_context = True  # the context goes with the model, its KV cache held here
    tracks_addresses = False

    def __init__(
        self, llm: Any, model_path: str, file_id: FileId, pinned_kv: bool, n_layer: int, weight_bytes: int
    ) -> None:
        self._llm = llm
        self.model_path = model_path
        self._file_id = file_id  # the file the model was loaded from: what a restore must read
        #: the snapshots' host memory, kept from one release to the next (freed at close)
        self.kv_memory = KvHostMemory(pinned_kv)
        self._n_layer = n_layer
        self.weight_bytes = weight_bytes
        self._kv: KvSnapshot | None = None

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV snapshot held while released (0 when none)."""
        return self._kv.nbytes if self._kv is not None else 0

    @property
    def kv_pinned(self) -> bool:
        return self._kv.pinned if self._kv is not None else False

    def weights_todo(self, resident: bool, kv: bool, keep_bytes: int | None) -> bool:
        """Everything goes (one part), unless ``keep_bytes`` covers the model and the KV cache stays."""
        return resident and (kv or keep_bytes is None or keep_bytes < self.weight_bytes)

    def resident_bytes(self, resident: bool) -> int:
        return self.weight_bytes if resident else 0

    def parts(self, resident: bool) -> list[WeightPart]:
        return [WeightPart(0, 0, max(self._n_layer - 1, 0), self.weight_bytes, resident)]

    release_steps = ReleaseSteps()  # (frozen: the rebuild path times no steps)
    restore_steps = RestoreSteps()

    @property
    def attach_steps(self) -> dict[str, float]:
        return {}

    def release(self, keep_bytes: int | None = None, final: bool = False) -> Weights:
        """Snapshot the KV cache, then free the context and the model (stand-ins take their
        place): all of it, whatever ``keep_bytes``."""
        llm = self._llm
        ctx_obj, model_obj = llm._ctx, llm._model
        self._kv = KvSnapshot.take(ctx_obj.ctx, self.kv_memory)
        ctx_obj.close()
        model_obj.close()
        llm._ctx = Released("context")
        llm._model = Released("model")
        point_tokenizer(llm, llm._model)
        return Weights.NONE

    def restore(
        self, overlap: bool = False, kv: KvUpload | None = None, later: int = 0
    ) -> tuple[int, bool | None]:
        """Load the model again, make its context and apply the KV snapshot; returns the model's
        bytes (and None: where the weights are now is not known). Raises ModelFileChangedError
        (the file is gone or changed) or OutOfDeviceMemoryError; the model stays released either
        way. Never overlapped; ``kv`` and ``later`` are the in-place path's."""
        from llama_cpp import _internals

        llm = self._llm
        try:
            now = FileId.of(self.model_path)
        except OSError as exc:
            raise ModelFileChangedError(
                f"{self.model_path} is gone ({exc.strerror}): the model stays released; put the file back or "
                "restart the model"
            ) from exc
        if now != self._file_id:
            raise ModelFileChangedError(
                f"{self.model_path} changed on disk after the model was loaded (size or modification time "
                "differ): restoring from it is refused and the model stays released; restart the model to "
                "load the new file"
            )
        try:
            model: Any = _internals.LlamaModel(
                path_model=self.model_path, params=llm.model_params, verbose=llm.verbose
            )
        except ValueError as exc:
            raise OutOfDeviceMemoryError(
                f"cannot load {self.model_path} again ({exc}): the model stays released; free device memory "
                "(release or stop another model) and try again"
            ) from exc
        try:
            ctx = new_context(
                llm, model, self._kv, self.model_path, stays_released="the model stays released; "
            )
        except BaseException:
            model.close()
            raise
        self._kv = None  # applied and closed
        llm._stack.enter_context(contextlib.closing(model))
        llm._stack.enter_context(contextlib.closing(ctx))
        llm._model = model
        llm._ctx = ctx
        point_tokenizer(llm, model)
        return int(llama_cpp.llama_model_size(model.model)), None

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()
            self._kv = None
        self.kv_memory.close()
