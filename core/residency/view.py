"""A read-only view of the in-place path, for diagnostics (``Residency.inplace_view``): what the
raw-copy measurements and the benches read, without reaching into the path's own objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .inplace import InPlace


@dataclass(frozen=True)
class BufferInfo:
    """One weight buffer the in-place path releases and restores."""

    buft: int  # its ggml buffer type
    buft_name: str
    size: int
    #: restore uploads it in one copy per host allocation (its shadow mirrors its layout)
    mirror: bool


class InPlaceView:
    """What diagnostics may read of the in-place path; nothing here changes it (except that
    :attr:`shadow_segments` fills a deferred host shadow, as a restore would)."""

    __slots__ = ("_ip",)

    def __init__(self, ip: InPlace) -> None:
        self._ip = ip

    @property
    def buffers(self) -> tuple[BufferInfo, ...]:
        return tuple(BufferInfo(b.buft, b.buft_name, b.size, b.mirror) for b in self._ip.buffers)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the weight tensors (what a restore uploads), without alignment padding."""
        return self._ip.tensor_bytes

    @property
    def shadow_segments(self) -> list[tuple[int, int, int]]:
        """(offset, size, host address) of each allocation of the host shadow, in order."""
        return self._ip.shadow.segments

    @property
    def shadow_fill_s(self) -> float:
        return self._ip.host_shadow.fill_s

    @property
    def n_weight_tensors_seen(self) -> int:
        return self._ip.n_weight_tensors_seen

    @property
    def weights_listed(self) -> tuple[str, ...]:
        """Weights the warm-up graph did not show, found in the model's tensor lists."""
        return tuple(self._ip.weights_listed)
