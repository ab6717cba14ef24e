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


class RebuildPath:
    """Frees and rebuilds ``llm``'s model and context in place (the same ``llm`` object works
    again after :meth:`restore`). The loop thread's :class:`Residency` is its only caller."""

    def __init__(self, llm: Any, model_path: str, file_id: FileId, pinned_kv: bool) -> None:
        self._llm = llm
        self.model_path = model_path
        self._file_id = file_id  # the file the model was loaded from: what a restore must read
        self._pinned_kv = pinned_kv
        self._kv: KvSnapshot | None = None

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV snapshot held while released (0 when none)."""
        return self._kv.nbytes if self._kv is not None else 0

    @property
    def kv_pinned(self) -> bool:
        return self._kv.pinned if self._kv is not None else False

    def release(self) -> None:
        """Snapshot the KV cache, then free the context and the model (stand-ins take their place)."""
        llm = self._llm
        ctx_obj, model_obj = llm._ctx, llm._model
        self._kv = KvSnapshot.take(ctx_obj.ctx, self._pinned_kv)
        ctx_obj.close()
        model_obj.close()
        llm._ctx = Released("context")
        llm._model = Released("model")
        point_tokenizer(llm, llm._model)

    def restore(self) -> int:
        """Load the model again, make its context and apply the KV snapshot; returns the model's
        bytes. Raises ModelFileChangedError (the file is gone or changed) or
        OutOfDeviceMemoryError; the model stays released either way."""
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
        return int(llama_cpp.llama_model_size(model.model))

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()
            self._kv = None
