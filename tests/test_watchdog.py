"""The hung-holder watchdog: a worker that holds the GPU while another model waits and answers no
status ping for ``arena.hung_holder_s`` is killed by its pool and restarted; the waiter goes on.

Real workers on the demo models; the hang is a SIGSTOP (a stopped process answers nothing)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _proc_util import alive, wait_until
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.client import TokenClient
from timeshare.core.arena.dirs import read_holder
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.config.validate import validate
from timeshare.core.errors import ConfigError
from timeshare.core.pool.record import WorkerRecord
from timeshare.core.pool.supervisor import Pool
from timeshare.core.pool.watchdog import HolderWatchdog, tick_period
from timeshare.core.sampling import Sampling
from timeshare.core.state import EventKind, PoolEvent
from timeshare.core.wire.protocol import Connection, StatusRequest

WAIT = 600.0  # generous: loaded machines; nothing here is timed
HUNG_S = 5.0
PROMPT = "The capital of France is"


def test_hung_holder_s_is_validated() -> None:
    assert ArenaConfig().hung_holder_s == 30.0
    assert validate({"arena": {"hung_holder_s": 0}}, check_paths=False).arena.hung_holder_s == 0.0
    for bad, problem in (
        (-1, "must be >= 0"),
        ("x", "must be a number"),
        (float("inf"), "must be a finite number"),
    ):
        with pytest.raises(ConfigError) as info:
            validate({"arena": {"hung_holder_s": bad}}, check_paths=False)
        assert f"arena.hung_holder_s: {problem}" in str(info.value)


def test_tick_period() -> None:
    assert tick_period(0) == 1.0  # off: it only looks whether it was turned on
    assert tick_period(30) == 1.0
    assert tick_period(2) == pytest.approx(0.4)
    assert tick_period(0.01) == 0.05


def test_a_stopped_holder_is_killed_the_waiter_answered_and_it_comes_back(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    arena = tmp_path / "arena"
    config = Config(
        models=(
            ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512, n_seq=2, idle_sleep_s=None),
            ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=512, n_seq=2, idle_sleep_s=None),
        ),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, hung_holder_s=HUNG_S),
    )
    pool = Pool(
        config,
        arena_dir=arena,
        log_dir=tmp_path / "log",
        kv_dir=tmp_path / "kv",
        restart_backoff_s=0.2,
    )
    events: list[PoolEvent] = []
    pool.subscribe(events.append)
    pool.start()
    stopped: int | None = None
    try:
        pool.wait_ready(timeout=WAIT)

        def answer(model: str) -> str:
            return (
                pool.generate(model, prompt=PROMPT, sampling=Sampling(max_tokens=8)).result(timeout=WAIT).text
            )

        gemma_ref = answer("gemma")
        smol_ref = answer("smol")  # smol answers last: it keeps the GPU (nobody asked for it)

        def smol_holds() -> bool:
            record = read_holder(arena)
            return record is not None and record.model == "smol"

        wait_until(smol_holds, WAIT, "smol holding the GPU")
        smol_pid = next(m.pid for m in pool.snapshot().models if m.id == "smol")
        assert smol_pid is not None
        os.kill(smol_pid, signal.SIGSTOP)  # hung: its doorbell never answers, nor its pings
        stopped = smol_pid

        assert answer("gemma") == gemma_ref  # answered once the watchdog killed the holder
        assert not alive(smol_pid)
        # events reach subscribers on the pool's event thread: the CRASHED one may come a moment later
        wait_until(
            lambda: any(e.kind is EventKind.CRASHED and e.model == "smol" for e in events),
            WAIT,
            "smol's CRASHED event",
        )
        killed = [e for e in events if e.kind is EventKind.CRASHED and e.model == "smol"]
        assert len(killed) == 1, [e.message for e in killed]
        why = str(killed[0].extra.get("watchdog", ""))
        assert "held the GPU while gemma waited" in why and "answered no status ping" in why
        assert killed[0].message.startswith("smol was killed: it held the GPU")
        reasons = [m.reason for e in events for m in e.snapshot.models if m.id == "smol"]
        assert any("killed because it held the GPU while gemma waited" in r for r in reasons)

        # the killed model restarts by itself and answers as before
        wait_until(
            lambda: any(e.kind is EventKind.RESTARTED and e.model == "smol" for e in events),
            WAIT,
            "smol restarted",
        )
        assert answer("smol") == smol_ref
        snap = {m.id: m for m in pool.snapshot().models}
        assert snap["smol"].pid not in (None, smol_pid) and snap["smol"].restarts == 1
        assert snap["gemma"].restarts == 0  # the waiter was never touched
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        pool.stop()


# ---- the watchdog's judgement, with real arena clients (no llama) ---------------------------------

DRIVER = str(Path(__file__).resolve().parent / "_arena_util.py")


def _driver(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, DRIVER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _end(proc: subprocess.Popen[str], *conns: Connection | None) -> None:
    proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
    for conn in conns:
        if conn is not None:
            conn.close()


def _record(model: str, proc: subprocess.Popen[str], tmp_path: Path) -> tuple[WorkerRecord, Connection]:
    """A pool's record of ``proc`` whose connection nobody on the other end reads (as a stopped
    worker's): the test reads the pings from the returned end and answers when it wants."""
    ours, theirs = socket.socketpair()
    w = WorkerRecord(config=ModelConfig(id=model, path="/m.gguf"), log_path=tmp_path / "log", pinned=False)
    w.proc, w.pid, w.conn = proc, proc.pid, Connection(ours)  # type: ignore[assignment]
    return w, Connection(theirs)


def _silent_for(wd: HolderWatchdog, workers: list[WorkerRecord], arena: Path, limit: float) -> list[str]:
    found: list[str] = []

    def named() -> bool:
        found.extend(why for _, why in wd.check(workers, arena, limit))
        return bool(found)

    wait_until(named, WAIT, "the watchdog naming a silent worker")
    return found


def test_watchdog_names_a_silent_holder_but_not_one_that_answers(tmp_path: Path) -> None:
    arena = tmp_path / "arena"
    holder = _driver("hold", str(arena), "auto", "held")
    client = TokenClient(Arena(arena), "waiter")
    w: WorkerRecord | None = None
    peer: Connection | None = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
        w, peer = _record("held", holder, tmp_path)
        wd = HolderWatchdog()
        assert wd.check([w], arena, 0.2) == []  # nobody waits: nothing to ask
        req = client.request(timeout=WAIT)
        wait_until(lambda: req.ticket is not None, WAIT, "a waiter")
        assert wd.check([w], arena, 0.2) == []  # pinged now
        ping = peer.recv()
        assert isinstance(ping, StatusRequest)
        wd.answered(w, ping.req)  # an answer: the next look pings again, no kill
        assert wd.check([w], arena, 0.2) == []
        assert isinstance(peer.recv(), StatusRequest)
        whys = _silent_for(wd, [w], arena, 0.2)  # this one is never answered
        assert whys == [whys[0]] and whys[0].startswith("held the GPU while waiter waited")
        assert "answered no status ping for" in whys[0]
        wd.close()
    finally:
        _end(holder, w.conn if w else None, peer)
        client.close()


def test_watchdog_names_a_silent_head_waiter_that_blocks_the_queue(tmp_path: Path) -> None:
    arena = tmp_path / "arena"
    foreign = TokenClient(Arena(arena), "foreign")  # held by a process of another pool
    foreign.acquire(timeout=WAIT)
    head = _driver("once", str(arena), "auto", "head", str(tmp_path / "order.jsonl"))
    behind = TokenClient(Arena(arena), "behind")
    w: WorkerRecord | None = None
    peer: Connection | None = None
    try:
        assert head.stdout is not None and head.stdout.readline().startswith("TICKET")
        w, peer = _record("head", head, tmp_path)
        wd = HolderWatchdog()
        assert wd.check([w], arena, 0.2) == []  # alone in the queue: it blocks nobody
        req = behind.request(timeout=WAIT)
        wait_until(lambda: req.ticket is not None, WAIT, "a waiter behind the head")
        whys = _silent_for(wd, [w], arena, 0.2)
        assert whys[0].startswith("headed the GPU queue while behind waited"), whys
        wd.close()
    finally:
        _end(head, w.conn if w else None, peer)
        behind.close()
        foreign.close()
