"""A generated vision projector (issue 41): a small, real mmproj GGUF with random weights that
llama.cpp's libmtmd loads and runs, for a text model of a given ``n_embd``. No vision GGUF exists
on the package registries and the test machines reach no model hub, so the tests, ``doctor`` and
the benches make one. Its answers mean nothing; it exercises every mechanism a real projector does
(the clip context's own weight buffers, image chunks in the KV cache, the image's content hash).

Two kinds, both layouts libmtmd of llama-cpp-python 0.3.36 loads (``tools/mtmd/clip.cpp``:
``load_hparams`` / ``load_tensors``; the keys are gguf's ``Keys.Clip*``):

- ``"mlp"``: LLaVA-1.5's shape, a CLIP ViT and a two-layer MLP (``mm.0``, ``mm.2``); the text
  model's attention stays causal over the image, so image chunks batch like text. For
  SmolLM2-135M (``n_embd`` 576).
- ``"gemma3"``: Gemma 3's shape, a SigLIP ViT, an average pool and ``mm.input_projection`` after an
  RMS norm; libmtmd asks for non-causal attention over the image tokens
  (``mtmd_decode_use_non_causal``). For Gemma-3-270M (``n_embd`` 640).

The image is resized to ``image_size`` (64 px by default) and gives ``(image_size / patch_size /
merge)²`` tokens: 16 by default, so a test prompt stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

Kind = Literal["mlp", "gemma3"]

#: which generated kind suits each architecture of the demo models (the text model's n_embd is read
#: from its GGUF)
KIND_FOR_ARCH: dict[str, Kind] = {"llama": "mlp", "gemma3": "gemma3"}


@dataclass(frozen=True)
class ProjectorShape:
    """The generated vision tower: small enough that a test encodes an image in milliseconds."""

    image_size: int = 64
    patch_size: int = 16
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    n_layer: int = 2
    #: gemma3 only: the side of the average pool over the patch grid
    merge: int = 1

    def n_image_tokens(self, kind: Kind) -> int:
        side = self.image_size // self.patch_size
        if kind == "gemma3":
            side //= self.merge
        return side * side


def write_projector(
    out: Path,
    n_embd_text: int,
    kind: Kind = "mlp",
    shape: ProjectorShape | None = None,
    seed: int = 0,
) -> Path:
    """Write a generated projector to ``out`` whose output width is ``n_embd_text`` (libmtmd
    refuses a projector whose width differs from the text model's ``n_embd``)."""
    import gguf

    s = shape or ProjectorShape()
    if s.image_size % s.patch_size or (kind == "gemma3" and (s.image_size // s.patch_size) % s.merge):
        raise ValueError(f"image_size {s.image_size} is not a whole number of patches and merges")
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_name(f"generated {kind} projector (random weights, Timeshare tests)")
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, kind)
    v = gguf.Keys.ClipVision
    w.add_uint32(v.IMAGE_SIZE, s.image_size)
    w.add_uint32(v.PATCH_SIZE, s.patch_size)
    w.add_uint32(v.EMBEDDING_LENGTH, s.n_embd)
    w.add_uint32(v.FEED_FORWARD_LENGTH, s.n_ff)
    w.add_uint32(v.PROJECTION_DIM, n_embd_text)
    w.add_uint32(v.BLOCK_COUNT, s.n_layer)
    w.add_uint32(v.Attention.HEAD_COUNT, s.n_head)
    w.add_float32(v.Attention.LAYERNORM_EPS, 1e-6)
    w.add_array(v.IMAGE_MEAN, [0.5, 0.5, 0.5])
    w.add_array(v.IMAGE_STD, [0.5, 0.5, 0.5])
    w.add_bool(v.USE_GELU, True)
    if kind == "gemma3":
        w.add_uint32(v.Projector.SCALE_FACTOR, s.merge)
    rng = np.random.default_rng(seed)

    def tensor(name: str, numpy_shape: tuple[int, ...], scale: float = 0.05, center: float = 0.0) -> None:
        data = rng.standard_normal(numpy_shape) * scale + center
        # the patch embedding is a convolution kernel: F16, as the converters write it
        dtype = np.float16 if name == "v.patch_embd.weight" else np.float32
        w.add_tensor(name, data.astype(dtype))

    e = s.n_embd
    n_pos = (s.image_size // s.patch_size) ** 2
    # numpy shapes are ggml's ne reversed
    tensor("v.patch_embd.weight", (e, 3, s.patch_size, s.patch_size))
    tensor("v.patch_embd.bias", (e,))
    tensor("v.position_embd.weight", (n_pos, e))
    for i in range(s.n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"v.blk.{i}.{name}.weight", (e, e))
            tensor(f"v.blk.{i}.{name}.bias", (e,))
        for name in ("ln1", "ln2"):
            tensor(f"v.blk.{i}.{name}.weight", (e,), center=1.0)
            tensor(f"v.blk.{i}.{name}.bias", (e,))
        tensor(f"v.blk.{i}.ffn_up.weight", (s.n_ff, e))
        tensor(f"v.blk.{i}.ffn_up.bias", (s.n_ff,))
        tensor(f"v.blk.{i}.ffn_down.weight", (e, s.n_ff))
        tensor(f"v.blk.{i}.ffn_down.bias", (e,))
    if kind == "mlp":
        tensor("v.pre_ln.weight", (e,), center=1.0)
        tensor("v.pre_ln.bias", (e,))
        tensor("mm.0.weight", (n_embd_text, e))
        tensor("mm.0.bias", (n_embd_text,))
        tensor("mm.2.weight", (n_embd_text, n_embd_text))
        tensor("mm.2.bias", (n_embd_text,))
    else:
        tensor("v.post_ln.weight", (e,), center=1.0)
        tensor("v.post_ln.bias", (e,))
        tensor("mm.soft_emb_norm.weight", (e,), center=1.0)
        tensor("mm.input_projection.weight", (e, n_embd_text))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def write_projector_for(model: Path, out: Path, shape: ProjectorShape | None = None, seed: int = 0) -> Path:
    """A generated projector that fits ``model`` (its architecture picks the kind, its
    ``embedding_length`` the width)."""
    import mmap

    from ..gguf.header import parse_metadata

    with model.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        values = parse_metadata(buf, len(buf))[4]
    arch = str(values.get("general.architecture", ""))
    n_embd = values.get(f"{arch}.embedding_length")
    if not isinstance(n_embd, int):
        raise ValueError(f"{model.name} has no {arch}.embedding_length")
    return write_projector(out, n_embd, KIND_FOR_ARCH.get(arch, "mlp"), shape, seed)
