"""A loaded model's vision projector (issue 41): libmtmd through llama-cpp-python's ``mtmd_cpp``,
driven by the worker's loop thread beside the engine.

What it does for the engine:

- **decode an image** (``decode_image``): the bytes the API checked (PNG, JPEG, WebP, GIF, BMP)
  become RGB with Pillow, within ``MAX_PIXELS``; libmtmd then resizes and normalises them as its
  projector needs (the same preprocessing llama-server uses);
- **tokenize** a prompt that holds images (``tokenize``): the prompt text carries this context's
  own media marker (a random one per worker, so no text a user writes can become an image slot)
  where each image goes; ``mtmd_tokenize`` splits it into text and image chunks (adding the
  projector's own wrapper tokens, e.g. Gemma 3's ``<start_of_image>``). The result is one token
  list for the decoder, in which an image's positions hold **placeholder ids**: negative numbers
  derived from the image's content hash (sha256 of its RGB pixels and size) and the position in
  it, never a vocabulary id. So the prompt cache, the conversations' sequences and the KV files,
  which match token ids, match an image by its content: a second turn about the same image
  reuses its KV and evaluates only the new text (``ImageSpan`` says where each image lies);
- **evaluate an image** (``evaluate``): the projector encodes it (``mtmd_encode_chunk``, once its
  weights are back: ``ready``, the residency's ``projector_ready``; the
  output is kept in a small LRU by content hash, so the same image in another sequence is not
  encoded again) and ``mtmd_helper_decode_image_chunk`` puts its embeddings into the sequence's
  KV cache in one ``llama_decode`` of that image alone (libmtmd's batch of embeddings cannot hold
  text tokens, and Gemma 3's image attends to itself non-causally: the context's causal
  attention is switched off for that decode only). The decoder calls it between its steps.

Projectors whose text model takes several positions per token (M-RoPE: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, GLM-4V) are refused at load: the decoder gives every token one position.

After a rebuild-path restore (core/residency) the llama model is another object: the mtmd
context, which holds a pointer to it, is made again (``ensure``).
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from ..errors import InvalidInputError, ModelFileError
from ..residency import ProjectorWatch
from ..wire.protocol import MAX_IMAGE_PIXELS

log = logging.getLogger(__name__)

#: the most pixels one image may have (the API refuses more before decoding; checked again here)
MAX_PIXELS = MAX_IMAGE_PIXELS
#: the encoded images kept by content hash (bytes of float32 embeddings)
ENCODED_CACHE_BYTES = 64 * 1024 * 1024


def placeholder_ids(digest: bytes, n_tokens: int) -> list[int]:
    """The ids that stand for an image's ``n_tokens`` positions in a token list: negative (never a
    vocabulary id), one per position, derived from the image's content hash."""
    out: list[int] = []
    for i in range(n_tokens):
        h = hashlib.blake2b(digest + i.to_bytes(4, "little"), digest_size=4).digest()
        out.append(-1 - (int.from_bytes(h, "little") & 0x3FFFFFFF))
    return out


@dataclass(eq=False)
class ImageSpan:
    """An image in a prompt's token list: it fills ``n_tokens`` positions from ``start``.
    ``chunk`` is libmtmd's (a copy this span owns: ``close`` frees it)."""

    start: int
    n_tokens: int
    digest: bytes
    chunk: Any = field(repr=False)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    def close(self) -> None:
        if self.chunk:
            mtmd.mtmd_input_chunk_free(self.chunk)
            self.chunk = None


def close_spans(spans: dict[int, ImageSpan] | None) -> None:
    for span in (spans or {}).values():
        span.close()


def snap_to_image_start(reuse: int, spans: dict[int, ImageSpan] | None) -> int:
    """A cut at ``reuse`` tokens moved back to the start of the image it falls inside (an image's
    KV is made in one piece: never kept in part)."""
    for span in (spans or {}).values():
        if span.start < reuse < span.end:
            return span.start
    return reuse


@dataclass(frozen=True)
class Rgb:
    width: int
    height: int
    pixels: bytes  # width * height * 3

    @property
    def digest(self) -> bytes:
        h = hashlib.sha256()
        h.update(self.width.to_bytes(4, "little") + self.height.to_bytes(4, "little"))
        h.update(self.pixels)
        return h.digest()


def decode_image(data: bytes, where: str = "image") -> Rgb:
    """An image file's pixels as RGB (Pillow; the first frame of an animation). Raises
    InvalidInputError naming ``where`` for anything that is not an image it can read whole."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            if width * height > MAX_PIXELS:
                raise InvalidInputError(
                    f"{where} is {width}x{height} pixels, over the {MAX_PIXELS:,} this model takes"
                )
            rgb = im.convert("RGB")
            rgb.load()
            return Rgb(width, height, rgb.tobytes())
    except InvalidInputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidInputError(f"{where} cannot be read as an image ({exc})") from None


class Vision:
    """The projector of one loaded model (see the module docstring). Not thread-safe: the worker's
    loop thread is the only caller."""

    def __init__(
        self, llm: Any, path: str, *, n_threads: int, device: Any = None, use_gpu: bool = True
    ) -> None:
        self.llm = llm
        self.path = path
        self.marker = f"<__timeshare_image_{secrets.token_hex(8)}__>"
        self._marker_bytes = self.marker.encode()
        self._n_threads = n_threads
        self._device = device
        self._use_gpu = use_gpu
        self._ctx: Any = None
        self._model_ptr: Any = None
        self._encoded: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._encoded_bytes = 0
        self.encodes = 0  # images the projector encoded (the rest came from the LRU)
        #: called before the projector's weights compute (an encode): Residency.projector_ready
        #: where they are released and restored with the model's (their restore runs off the
        #: first token's path); raises its error (the image's request fails)
        self.ready: Callable[[], None] = _nothing
        self.weight_bytes = projector_weight_bytes(path)
        _route_logs()
        self._init()
        self.non_causal = False  # set by the first image chunk's answer (libmtmd asks per chunk)

    def _init(self) -> None:
        # the clip scheduler's eval callback: libmtmd's warm-up encode at init shows the
        # projector's weights to it, for the residency (core/residency/projector.py)
        self.watch = ProjectorWatch()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = self._use_gpu
        params.n_threads = self._n_threads
        params.print_timings = False
        params.warmup = True
        params.cb_eval = self.watch.callback
        params.cb_eval_user_data = None
        params.media_marker = self._marker_bytes
        if self._device is not None:
            params.device = self._device
        model = self.llm.model
        ctx = mtmd.mtmd_init_from_file(self.path.encode(), model, params)
        if not ctx:
            raise ModelFileError(
                f"the projector {self.path} cannot be loaded by llama.cpp (libmtmd): it is not a "
                "projector GGUF, or it was made for another model (its n_embd must match the model's); "
                "see the worker log"
            )
        if not mtmd.mtmd_support_vision(ctx):
            mtmd.mtmd_free(ctx)
            raise ModelFileError(f"the projector {self.path} has no vision encoder (an audio-only one?)")
        if mtmd.mtmd_decode_use_mrope(ctx):
            mtmd.mtmd_free(ctx)
            raise ModelFileError(
                f"the projector {self.path} is for a model that gives each image token several positions "
                "(M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V), which this Timeshare does not evaluate yet"
            )
        self._ctx = ctx
        self._model_ptr = model
        self._show_weights()

    def _show_weights(self) -> None:
        """Encode a blank image once, so the watch sees the weights of the whole vision tower
        (libmtmd's own warm-up only reserves the graph's memory; it computes nothing)."""
        side = 64
        pixels = (ctypes.c_uint8 * (side * side * 3))(*([128] * (side * side * 3)))
        bm = mtmd.mtmd_bitmap_init(side, side, pixels)
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            it = mtmd.mtmd_input_text()
            it.text, it.text_len, it.add_special, it.parse_special = (
                self._marker_bytes,
                len(self._marker_bytes),
                False,
                True,
            )
            arr = (mtmd.mtmd_bitmap_p_ctypes * 1)(bm)
            if mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(it), arr, 1) != 0:
                log.warning("the projector's warm-up image could not be tokenized")
                return
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    if mtmd.mtmd_encode_chunk(self._ctx, chunk) != 0:
                        log.warning("the projector's warm-up encode failed")
                    return
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bm)

    def ensure(self) -> None:
        """Make the mtmd context again when the llama model is another object (a rebuild-path
        restore frees the model and loads it again)."""
        if self.llm.model != self._model_ptr:
            log.info("the model was loaded again: its projector's context is made again")
            if self._ctx:
                mtmd.mtmd_free(self._ctx)
                self._ctx = None
            self._init()

    @property
    def n_embd(self) -> int:
        return int(llama_cpp.llama_model_n_embd_inp(self.llm.model))

    def tokenize(
        self, text: str, images: Sequence[bytes], *, add_special: bool, parse_special: bool
    ) -> tuple[list[int], dict[int, ImageSpan]]:
        """``text`` (holding ``self.marker`` once per image, in order) as one token list with
        placeholder ids where the images go, and the images' spans by start. Raises
        InvalidInputError for an image it cannot read."""
        self.ensure()
        if text.count(self.marker) != len(images):
            raise RuntimeError(f"{len(images)} image(s) but {text.count(self.marker)} markers in the prompt")
        bitmaps: list[Any] = []
        chunks = mtmd.mtmd_input_chunks_init()
        spans: dict[int, ImageSpan] = {}
        try:
            for i, data in enumerate(images):
                rgb = decode_image(data, f"image {i + 1}" if len(images) > 1 else "the image")
                buf = (ctypes.c_uint8 * len(rgb.pixels)).from_buffer_copy(rgb.pixels)
                bm = mtmd.mtmd_bitmap_init(rgb.width, rgb.height, buf)
                if not bm:
                    raise InvalidInputError(f"image {i + 1} could not be prepared for the projector")
                bitmaps.append(bm)
                mtmd.mtmd_bitmap_set_id(bm, rgb.digest.hex().encode())
            encoded = text.encode("utf-8")
            it = mtmd.mtmd_input_text()
            it.text = encoded
            it.text_len = len(encoded)
            it.add_special = add_special
            it.parse_special = parse_special
            arr = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(it), arr, len(bitmaps))
            if rc != 0:
                raise InvalidInputError(f"the projector could not take these images (libmtmd: {rc})")
            tokens: list[int] = []
            seen: dict[bytes, int] = {}
            try:
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                    kind = mtmd.mtmd_input_chunk_get_type(chunk)
                    if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                        n = ctypes.c_size_t()
                        ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                        tokens.extend(int(ptr[j]) for j in range(n.value))
                        continue
                    if kind != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                        raise InvalidInputError("the projector made a chunk that is not an image")
                    n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                    if int(mtmd.mtmd_input_chunk_get_n_pos(chunk)) != n_tokens:
                        raise InvalidInputError("the projector gives this image more positions than tokens")
                    self.non_causal = bool(mtmd.mtmd_decode_use_non_causal(self._ctx, chunk))
                    n_ubatch = int(llama_cpp.llama_n_ubatch(self.llm.ctx))
                    if self.non_causal and n_tokens > n_ubatch:
                        raise InvalidInputError(
                            f"an image takes {n_tokens} tokens, more than the {n_ubatch} one decode of "
                            "this model holds (its image attends to itself as a whole)"
                        )
                    # an image may come as several chunks (a projector that slices it): each its own
                    # hash, from the image's and its rank among them
                    ident = mtmd.mtmd_input_chunk_get_id(chunk) or b""
                    seen[ident] = seen.get(ident, -1) + 1
                    digest = hashlib.sha256(ident + seen[ident].to_bytes(4, "little")).digest()
                    span = ImageSpan(len(tokens), n_tokens, digest, mtmd.mtmd_input_chunk_copy(chunk))
                    spans[span.start] = span
                    tokens.extend(placeholder_ids(digest, n_tokens))
            except BaseException:
                close_spans(spans)
                raise
            return tokens, spans
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)

    def _encode(self, span: ImageSpan) -> np.ndarray:
        """The projector's output for the image (a copy)."""
        self.ready()
        rc = mtmd.mtmd_encode_chunk(self._ctx, span.chunk)
        if rc != 0:
            raise RuntimeError(f"the projector could not encode an image (libmtmd: {rc})")
        self.encodes += 1
        ptr = mtmd.mtmd_get_output_embd(self._ctx)
        size = span.n_tokens * self.n_embd
        return np.array(np.ctypeslib.as_array(ptr, shape=(size,)), copy=True)

    def encode_image(self, data: bytes) -> np.ndarray:
        """The projector's embeddings of one image file, encoded now (the doctor compares them
        across release/restore cycles)."""
        _tokens, spans = self.tokenize(self.marker + ".", [data], add_special=False, parse_special=True)
        try:
            return self._encode(next(iter(spans.values())))
        finally:
            close_spans(spans)

    def _embeddings(self, span: ImageSpan) -> np.ndarray:
        """The image's embeddings: from the LRU, or encoded by the projector now."""
        got = self._encoded.get(span.digest)
        if got is not None:
            self._encoded.move_to_end(span.digest)
            return got
        embd = self._encode(span)
        self._encoded[span.digest] = embd
        self._encoded_bytes += embd.nbytes
        while self._encoded_bytes > ENCODED_CACHE_BYTES and len(self._encoded) > 1:
            _, old = self._encoded.popitem(last=False)
            self._encoded_bytes -= old.nbytes
        return embd

    def forget_encoded(self) -> None:
        """Drop the encoded images kept by content hash: the next image runs the projector (the
        doctor and the tests check its weights after a restore this way)."""
        self._encoded.clear()
        self._encoded_bytes = 0

    def evaluate(self, ctx: Any, span: ImageSpan, n_past: int, seq_id: int, n_batch: int) -> None:
        """Put the image's embeddings into sequence ``seq_id`` at positions ``n_past``.. (one
        llama_decode of the image alone; see the module docstring). Raises RuntimeError when
        llama.cpp refuses it."""
        self.ensure()
        embd = self._embeddings(span)
        new_n_past = llama_cpp.llama_pos(0)
        rc = mtmd.mtmd_helper_decode_image_chunk(
            self._ctx,
            ctx,
            span.chunk,
            embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            n_past,
            seq_id,
            n_batch,
            ctypes.byref(new_n_past),
            _NO_CALLBACK,
            None,
        )
        if rc != 0:
            raise RuntimeError(f"llama_decode of an image returned {rc}")

    def close(self) -> None:
        self._encoded.clear()
        self._encoded_bytes = 0
        if self._ctx:
            mtmd.mtmd_free(self._ctx)
            self._ctx = None


def _nothing() -> None:
    pass


def projector_weight_bytes(path: str) -> int:
    """The bytes of a projector GGUF's tensors (what its weights take, as the file holds them)."""
    import mmap

    from ..gguf.header import parse_header

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return sum(parse_header(buf, len(buf)).type_bytes.values())


_LOG_CALLBACK: Any = None
#: no post-decode callback (a NULL function pointer)
_NO_CALLBACK: Any = mtmd.mtmd_helper_post_decode_callback()


def _route_logs() -> None:
    """libmtmd's log lines go to this module's logger (warnings and errors; its per-image
    progress lines at debug) instead of the worker's stderr. The callback stays referenced."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    def forward(level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", "replace").rstrip()
        if not line:
            return
        if level >= 4:  # GGML_LOG_LEVEL_ERROR
            log.error("libmtmd: %s", line)
        elif level == 3:  # WARN
            log.warning("libmtmd: %s", line)
        else:
            log.debug("libmtmd: %s", line)

    _LOG_CALLBACK = llama_cpp.llama_log_callback(forward)
    mtmd.mtmd_helper_log_set(_LOG_CALLBACK, None)
