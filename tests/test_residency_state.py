"""The residency state table (core/residency/state.py): a release only lowers where the weights and
the KV cache are, a restore brings the weights back whole and then the KV cache, and nothing else
is allowed; the Residency's own moves go through it (tests/test_residency*.py drive the real ones)."""

from __future__ import annotations

import pytest
from timeshare.core.residency.state import (
    TRANSITIONS,
    Kv,
    ResidencyState,
    ResidencyTransitionError,
    Weights,
    check_transition,
)


def _is_release_step(old: ResidencyState, new: ResidencyState) -> bool:
    return new.weights <= old.weights and new.kv >= old.kv


def _is_restore_step(old: ResidencyState, new: ResidencyState) -> bool:
    # the weights come back whole (the KV cache stays where it was), or, with them whole, the KV cache
    return (new.weights is Weights.ALL and new.kv is old.kv) or (
        old.weights is Weights.ALL and new.weights is Weights.ALL and new.kv < old.kv
    )


def test_every_state_has_a_row_and_every_pair_of_facts_a_state() -> None:
    assert set(TRANSITIONS) == set(ResidencyState)
    assert {(s.weights, s.kv) for s in ResidencyState} == {(w, k) for w in Weights for k in Kv}
    for w in Weights:
        for k in Kv:
            assert ResidencyState.of(w, k).weights is w


@pytest.mark.parametrize("old", list(ResidencyState), ids=lambda s: s.name)
def test_each_allowed_move_is_a_release_step_or_a_restore_step(old: ResidencyState) -> None:
    for new in TRANSITIONS[old]:
        assert new is not old
        assert _is_release_step(old, new) or _is_restore_step(old, new), (old, new)


def test_a_release_never_brings_anything_back() -> None:
    for old in ResidencyState:
        for new in ResidencyState:
            if new is old:
                assert check_transition(old, new) is new  # staying put is always allowed
            elif not _is_restore_step(old, new) and not _is_release_step(old, new):
                with pytest.raises(ResidencyTransitionError, match=f"from {old.name} to {new.name}"):
                    check_transition(old, new)


def test_every_state_can_come_back_to_resident() -> None:
    for start in ResidencyState:
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert ResidencyState.RESIDENT in seen, start


def test_the_kv_cache_comes_back_only_with_the_whole_weights() -> None:
    with pytest.raises(ResidencyTransitionError):
        check_transition(ResidencyState.RELEASED_KV_ON_HOST, ResidencyState.RELEASED)
    with pytest.raises(ResidencyTransitionError):
        check_transition(ResidencyState.PARTLY_RESIDENT_KV_ON_HOST, ResidencyState.PARTLY_RESIDENT)
    resident = ResidencyState.RESIDENT
    assert check_transition(ResidencyState.RESIDENT_KV_ON_HOST, resident) is resident
