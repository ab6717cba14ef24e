"""A worker's lifecycle (core/pool/lifecycle.py) and the pool's error codes, without processes.

Every transition the table allows is walked from NEW; every other one must be refused; each phase
shows the ModelState the snapshots promise. The pool's code→exception mapping must give every code
a worker can send its own class.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from pathlib import Path

import pytest
from timeshare.core import errors
from timeshare.core.errors import TimeshareError
from timeshare.core.pool.codes import ERRORS_BY_CODE, error_for
from timeshare.core.pool.lifecycle import (
    MODEL_STATE,
    REPORTED,
    TRANSITIONS,
    Lifecycle,
    Phase,
    TransitionError,
)
from timeshare.core.state import ModelState

CORE = Path(__file__).resolve().parent.parent / "core"


def path_to(target: Phase) -> list[Phase]:
    """The shortest walk from NEW to ``target`` through allowed transitions."""
    seen = {Phase.NEW: [Phase.NEW]}
    todo = deque([Phase.NEW])
    while todo:
        phase = todo.popleft()
        for nxt in sorted(TRANSITIONS[phase], key=lambda p: p.value):
            if nxt not in seen:
                seen[nxt] = [*seen[phase], nxt]
                todo.append(nxt)
    return seen[target]


def at(phase: Phase) -> Lifecycle:
    """A lifecycle brought to ``phase`` the way the pool would: by transitions from NEW."""
    lc = Lifecycle()
    for step in path_to(phase)[1:]:
        lc.transition(step)
    return lc


def test_the_table_names_every_phase_and_every_phase_is_reachable_from_new() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert set(MODEL_STATE) == set(Phase)
    for phase in Phase:
        assert path_to(phase)[-1] is phase
    assert Phase.NEW not in set().union(*TRANSITIONS.values())  # only the start
    assert TRANSITIONS[Phase.REMOVED] == frozenset()  # the end


@pytest.mark.parametrize(
    ("old", "new"), [(a, b) for a in Phase for b in sorted(TRANSITIONS[a], key=lambda p: p.value)]
)
def test_every_allowed_transition_is_taken(old: Phase, new: Phase) -> None:
    lc = at(old)
    assert lc.transition(new) is old
    assert lc.phase is new


def test_every_other_transition_is_refused_and_changes_nothing() -> None:
    refused = [(a, b) for a, b in itertools.product(Phase, Phase) if b not in TRANSITIONS[a]]
    assert refused  # the table is not "anything goes"
    for old, new in refused:
        lc = at(old)
        shown, after_crash = lc.model_state, lc.after_crash
        with pytest.raises(TransitionError, match=f"from {old.value} to {new.value}"):
            lc.transition(new)
        assert (lc.phase, lc.model_state, lc.after_crash) == (old, shown, after_crash)


def test_some_transitions_the_old_flags_allowed_are_refused() -> None:
    # a stopped worker cannot be "ready" or "stopping"; a removed one cannot come back
    for old, new in [
        (Phase.STOPPED, Phase.READY),
        (Phase.STOPPED, Phase.STOPPING),
        (Phase.STOPPING, Phase.READY),
        (Phase.STOPPING, Phase.BACKOFF),  # an exit after Shutdown is not a crash
        (Phase.FAILED, Phase.READY),
        (Phase.REMOVED, Phase.STARTING),
        (Phase.BACKOFF, Phase.LOADING),
    ]:
        with pytest.raises(TransitionError):
            at(old).transition(new)


def test_each_phase_shows_its_model_state() -> None:
    for phase, shown in MODEL_STATE.items():
        if shown is not None:
            assert at(phase).model_state is shown, phase
    assert at(Phase.NEW).model_state is ModelState.STARTING
    assert at(Phase.BACKOFF).model_state is ModelState.STARTING
    assert at(Phase.STOPPED).model_state is ModelState.STOPPED
    assert at(Phase.FAILED).model_state is ModelState.FAILED


def test_a_ready_worker_shows_its_own_report_and_others_ignore_reports() -> None:
    lc = at(Phase.READY)
    assert lc.model_state is ModelState.RELEASED  # until its first report
    for reported, shown in REPORTED.items():
        lc.report(reported)
        assert lc.model_state is shown
    for phase in Phase:
        if phase is not Phase.READY:
            other = at(phase)
            before = other.model_state
            other.report("resident")
            assert other.model_state is before, phase


@pytest.mark.parametrize("stop", [Phase.STOPPING, Phase.RESTARTING, Phase.REMOVING])
def test_a_worker_being_stopped_keeps_showing_its_last_state(stop: Phase) -> None:
    lc = at(Phase.READY)
    lc.report("sleeping")
    lc.transition(stop)
    assert lc.stopping and lc.model_state is ModelState.SLEEPING
    lc.report("resident")  # not READY: ignored
    assert lc.model_state is ModelState.SLEEPING
    loading = at(Phase.LOADING)
    loading.transition(stop)
    assert loading.model_state is ModelState.LOADING
    if stop is not Phase.REMOVING:
        lc.transition(Phase.STOPPED)
        assert lc.model_state is ModelState.STOPPED and not lc.stopping


def test_every_model_state_can_be_shown() -> None:
    shown = {s for s in MODEL_STATE.values() if s is not None} | set(REPORTED.values())
    assert shown == set(ModelState)


def test_after_crash_lasts_from_backoff_until_ready_or_a_deliberate_end() -> None:
    lc = at(Phase.READY)
    assert not lc.after_crash
    lc.transition(Phase.BACKOFF)
    assert lc.after_crash
    lc.transition(Phase.STARTING)
    lc.transition(Phase.LOADING)
    assert lc.after_crash  # the pool announces RESTARTED when this spawn is ready
    lc.transition(Phase.READY)
    assert not lc.after_crash
    for end in (Phase.STOPPED, Phase.FAILED, Phase.REMOVED):
        crashed = at(Phase.BACKOFF)
        assert crashed.after_crash
        crashed.transition(end)
        assert not crashed.after_crash


def test_a_spawn_that_meets_a_passing_shortage_retries_and_keeps_the_crash_flag() -> None:
    # too many open files (or no memory) at spawn: RETRYING, shown as starting, then spawned again
    for start in (Phase.NEW, Phase.STOPPED, Phase.FAILED, Phase.BACKOFF):
        lc = at(start)
        crashed = lc.after_crash
        lc.transition(Phase.RETRYING)
        assert lc.model_state is ModelState.STARTING and lc.after_crash is crashed
        lc.transition(Phase.RETRYING)  # failed again: another delay
        lc.transition(Phase.STARTING)
        assert lc.after_crash is crashed  # a restart after a crash is still announced as one
    for end in (Phase.FAILED, Phase.STOPPED, Phase.REMOVED):
        lc = at(Phase.RETRYING)
        lc.transition(end)
        assert not lc.after_crash
    with pytest.raises(TransitionError):
        at(Phase.RETRYING).transition(Phase.READY)


def test_a_failed_model_can_be_stopped_and_started_again() -> None:
    lc = at(Phase.FAILED)
    lc.transition(Phase.STOPPED)  # stopped on purpose: it shows stopped, not failed
    assert lc.model_state is ModelState.STOPPED
    lc.transition(Phase.STARTING)
    failed = at(Phase.FAILED)
    failed.transition(Phase.STARTING)  # the start verb (API, CLI, the tray's Restart)
    assert failed.model_state is ModelState.STARTING


# ---- a worker's error codes ------------------------------------------------------------------


def _literal_codes(tree: ast.AST) -> set[str]:
    """String constants given as ``code=...`` or assigned to a variable ``code``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        value: ast.AST | None = None
        if isinstance(node, ast.keyword) and node.arg == "code":
            value = node.value
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "code" for t in node.targets
        ):
            value = node.value
        if value is not None:
            found.update(
                n.value for n in ast.walk(value) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            )
    return found


def worker_codes() -> set[str]:
    """Every code a worker's ``Error`` can carry: the literals in core/worker, and the code of every
    TimeshareError (a worker sends ``exc.code`` of whatever it caught)."""
    literal: set[str] = set()
    for path in sorted((CORE / "worker").glob("*.py")):
        literal |= _literal_codes(ast.parse(path.read_text(), filename=str(path)))
    assert {"protocol", "internal", "model_unavailable", "invalid_config"} <= literal
    typed = {
        value.code
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, TimeshareError) and value is not TimeshareError
    }
    return literal | typed


def test_every_worker_error_code_maps_to_its_own_class() -> None:
    for code in sorted(worker_codes()):
        err = error_for(code, "it went wrong")
        assert type(err) is not TimeshareError, code
        assert err.code == code
        assert "it went wrong" in str(err)


def test_the_mapping_picks_the_class_that_defines_the_code() -> None:
    assert type(error_for("model_file_changed", "m")) is errors.ModelFileChangedError
    assert type(error_for("arena", "m")) is errors.ArenaError  # not a subclass that inherits the code
    assert type(error_for("protocol", "m")) is errors.ProtocolError
    config = error_for("invalid_config", "models[0].id: bad")
    assert isinstance(config, errors.ConfigError) and config.problems == ["models[0].id: bad"]
    unknown = error_for("made_up", "m")
    assert type(unknown) is TimeshareError and unknown.code == "made_up"
    assert all(cls.code == code for code, cls in ERRORS_BY_CODE.items())
