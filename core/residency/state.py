"""Where a loaded model's weights and KV cache are: the residency state, and the transitions
allowed between its states (as ``core/pool/lifecycle.py`` does for a worker's phases).

Two facts make a state: how much of the weights is on the device (:class:`Weights`) and where the
KV cache is (:class:`Kv`). A release only lowers them (fewer weights, the KV cache off the device);
a restore brings the weights back whole first and then the KV cache; nothing else moves them::

    RESIDENT ─release(keep_bytes)─► PARTLY_RESIDENT ─release─► RELEASED
        │                                 │                       │
        └─release(kv=True)────────────────┴─release(kv=True)──────┴─► *_KV_ON_HOST
    any ─restore: the weights─► RESIDENT (KV on the device) | RESIDENT_KV_ON_HOST ─the context─► RESIDENT

A deeper KV level (issue 39: the KV cache released on contention, or written to disk) is one more
:class:`Kv` member, ranked below ``HOST``, with its three states and their rows in the table.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Weights(enum.IntEnum):
    """How much of the weights is on the device (ordered: a release never raises it)."""

    NONE = 0
    SOME = 1  # some layer parts released (restore before computing)
    ALL = 2


class Kv(enum.IntEnum):
    """Where the KV cache is (ordered, deepest last: a release never brings it back)."""

    DEVICE = 0  # in its llama context on the device (set aside while the weights are released)
    HOST = 1  # a snapshot in host memory, the context freed (release(kv=True); the rebuild path)


class ResidencyState(enum.Enum):
    RESIDENT = (Weights.ALL, Kv.DEVICE)
    PARTLY_RESIDENT = (Weights.SOME, Kv.DEVICE)
    RELEASED = (Weights.NONE, Kv.DEVICE)
    RESIDENT_KV_ON_HOST = (Weights.ALL, Kv.HOST)  # the KV cache released alone, or a restore half-way
    PARTLY_RESIDENT_KV_ON_HOST = (Weights.SOME, Kv.HOST)
    RELEASED_KV_ON_HOST = (Weights.NONE, Kv.HOST)

    @property
    def weights(self) -> Weights:
        return self.value[0]

    @property
    def kv(self) -> Kv:
        return self.value[1]

    @classmethod
    def of(cls, weights: Weights, kv: Kv) -> ResidencyState:
        return cls((weights, kv))


_S = ResidencyState
_DEEPER_KV = (_S.RESIDENT_KV_ON_HOST, _S.PARTLY_RESIDENT_KV_ON_HOST, _S.RELEASED_KV_ON_HOST)

#: every allowed transition (staying put is always allowed); anything else raises
#: ResidencyTransitionError. A release step lowers one fact; a restore raises the weights to ALL,
#: then the KV cache to the device.
TRANSITIONS: Mapping[ResidencyState, frozenset[ResidencyState]] = {
    _S.RESIDENT: frozenset({_S.PARTLY_RESIDENT, _S.RELEASED, *_DEEPER_KV}),
    _S.PARTLY_RESIDENT: frozenset(
        {_S.RESIDENT, _S.RELEASED, _S.PARTLY_RESIDENT_KV_ON_HOST, _S.RELEASED_KV_ON_HOST}
    ),
    _S.RELEASED: frozenset({_S.RESIDENT, _S.RELEASED_KV_ON_HOST}),
    _S.RESIDENT_KV_ON_HOST: frozenset({_S.RESIDENT, _S.PARTLY_RESIDENT_KV_ON_HOST, _S.RELEASED_KV_ON_HOST}),
    _S.PARTLY_RESIDENT_KV_ON_HOST: frozenset({_S.RESIDENT_KV_ON_HOST, _S.RELEASED_KV_ON_HOST}),
    _S.RELEASED_KV_ON_HOST: frozenset({_S.RESIDENT_KV_ON_HOST}),
}


class ResidencyTransitionError(RuntimeError):
    """A transition the table does not allow: a bug in the residency code, not a user's mistake."""


def check_transition(old: ResidencyState, new: ResidencyState) -> ResidencyState:
    """``new`` when the table allows going there from ``old``; raises ResidencyTransitionError."""
    if new is not old and new not in TRANSITIONS[old]:
        raise ResidencyTransitionError(f"residency cannot go from {old.name} to {new.name}")
    return new
