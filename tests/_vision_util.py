"""Images and generated projectors for the vision tests (issue 41), and the oracle they compare
with: libmtmd called through llama-cpp-python directly, nothing of Timeshare in between."""

from __future__ import annotations

import ctypes
import io
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
from _e_worker_util import generate_message
from PIL import Image
from timeshare.core.diagnostics.synthetic_projector import ProjectorShape, write_projector_for
from timeshare.core.wire.protocol import ChatMessage, ImagePart, TokenLogprobs
from timeshare.core.worker.engine import Engine

#: the generated Gemma 3 projector's shape: 8-pixel patches pooled 2x2, 16 image tokens
GEMMA3_SHAPE = ProjectorShape(patch_size=8, merge=2)
QUESTION = "What is in this picture?"


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30), stripe: bool = False) -> bytes:
    """A PNG made with Pillow: one colour, optionally with a white stripe (another image of the
    same colour)."""
    im = Image.new("RGB", size, color)
    if stripe:
        for x in range(size[0]):
            im.putpixel((x, size[1] // 2), (255, 255, 255))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def projector_for(model: Path, out_dir: Path) -> Path:
    """A generated projector that fits ``model`` (mlp for SmolLM2, gemma3 for Gemma-3-270M)."""
    shape = GEMMA3_SHAPE if "gemma" in model.name.lower() else None
    return write_projector_for(model, out_dir / f"mmproj-generated-{model.stem}.gguf", shape)


class DirectMtmd:
    """A plain Llama and its mtmd context: evaluates a prompt with images and returns the last
    position's logits (the oracle the worker's answers are compared with)."""

    def __init__(self, model: Path, projector: Path, n_ctx: int = 512) -> None:
        self.llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_batch=n_ctx, n_threads=1, verbose=False)
        p = mtmd.mtmd_context_params_default()
        p.use_gpu = False
        p.n_threads = 1
        p.print_timings = False
        p.warmup = False
        self.ctx = mtmd.mtmd_init_from_file(str(projector).encode(), self.llm.model, p)
        assert self.ctx, f"libmtmd did not load {projector}"

    def support_vision(self) -> bool:
        return bool(mtmd.mtmd_support_vision(self.ctx))

    def first_logits(self, text: str, images: list[bytes], add_special: bool = True) -> np.ndarray:
        """``text`` holds ``<image>`` where each image goes; the KV cache is cleared first.
        ``add_special``: BOS as the vocabulary adds it (off for a chat template's text)."""
        bitmaps = []
        for img in images:
            arr = (ctypes.c_uint8 * len(img)).from_buffer_copy(img)
            bm = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, arr, len(img), False)
            assert bm, "libmtmd did not decode the image"
            bitmaps.append(bm)
        data = text.replace("<image>", mtmd.mtmd_default_marker().decode()).encode()
        it = mtmd.mtmd_input_text()
        it.text, it.text_len, it.add_special, it.parse_special = data, len(data), add_special, True
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            arr_b = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            assert mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(it), arr_b, len(bitmaps)) == 0
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm._ctx.ctx), True)
            n_past = llama_cpp.llama_pos(0)
            rc = mtmd.mtmd_helper_eval_chunks(
                self.ctx, self.llm._ctx.ctx, chunks, 0, 0, self.llm.n_batch, True, ctypes.byref(n_past)
            )
            assert rc == 0, rc
            logits = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
            return np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).copy()
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)

    def close(self) -> None:
        mtmd.mtmd_free(self.ctx)
        self.llm.close()


def ask(image: bytes, text: str = QUESTION, at: int = 0) -> ChatMessage:
    return ChatMessage("user", text, images=(ImagePart(image, at),))


class Run:
    """One request through the engine: its streamed text and its first token's logprobs."""

    def __init__(self, engine: Engine, name: str = "r", **fields: Any) -> None:
        fields.setdefault("max_tokens", 6)
        fields.setdefault("cache_prompt", False)
        fields.setdefault("logprobs", True)
        fields.setdefault("top_logprobs", 5)
        self.pieces: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prepared = engine.prepare(generate_message(name, **fields))
        self.live = engine.start(self.prepared, self.pieces.append, self.logprobs.extend)

    @property
    def first(self) -> TokenLogprobs:
        return self.logprobs[0]

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def alone(engine: Engine, **fields: Any) -> Run:
    run = Run(engine, **fields)
    while engine.active:
        engine.step()
    return run
