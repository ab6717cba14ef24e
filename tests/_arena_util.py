"""Real processes for the arena tests: ``python tests/_arena_util.py MODE ...`` runs one arena client
(no llama, just the token protocol), so the tests see real flock, real inotify, real kill -9.

Modes (all print one line per event on stdout, flushed):
  hold ARENA BACKEND MODEL [pinned] [bytes=N] [budget=SETTING] [release_ms=MS]
                                          acquire (N weight bytes under the budget SETTING, e.g.
                                          "1000B"; default: one model at a time), print HELD, keep
                                          it until stdin closes, release (saying that its release
                                          took MS ms; default: saying nothing, as an older version)
  contend ARENA BACKEND MODEL LOG N       N x (acquire, hold 1-8 ms, release, pause 0-4 ms)
  once ARENA BACKEND MODEL LOG            acquire (60 s timeout), log an "order" record, release
  busy ARENA BACKEND MODEL LOG TURNS QUANTUM_MS
                                          always wants the GPU, for TURNS turns: holds it until the
                                          doorbell rang and the quantum passed (or, alone, 2 s),
                                          releases, asks again; logs "token"
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path

from timeshare.core.arena.arena import Arena
from timeshare.core.arena.budget import compute_budget, parse_budget
from timeshare.core.arena.client import TokenClient
from timeshare.core.arena.records import DoorbellRing
from timeshare.core.observe import NULL_OBSERVER, EventLog

DRIVER = str(Path(__file__).resolve())


def _client(
    arena_dir: str,
    backend: str,
    model: str,
    log: str | None = None,
    pinned: bool = False,
    budget: str | None = None,
) -> TokenClient:
    arena = Arena(arena_dir, backend=backend)  # type: ignore[arg-type]
    wanted = compute_budget(parse_budget(budget), total=0, free=0, pid=os.getpid()) if budget else None
    observer = EventLog(log, model) if log else NULL_OBSERVER
    return TokenClient(arena, model, observer=observer, pinned=pinned, budget=wanted)


def main(argv: list[str]) -> int:
    mode, arena_dir, backend, model = argv[:4]
    rest = argv[4:]
    if mode == "hold":
        opts = dict(r.split("=", 1) for r in rest if "=" in r)
        client = _client(arena_dir, backend, model, pinned="pinned" in rest, budget=opts.get("budget"))
        client.acquire(timeout=60, need=int(opts["bytes"]) if "bytes" in opts else None)
        print("HELD", flush=True)
        sys.stdin.read()  # until the test closes stdin (or kills us)
        client.release(release_ms=float(opts["release_ms"]) if "release_ms" in opts else None)
        print("RELEASED", flush=True)
        return 0
    if mode == "contend":
        log, n = rest[0], int(rest[1])
        client = _client(arena_dir, backend, model, log)
        rng = random.Random(os.getpid())
        for _ in range(n):
            client.acquire(timeout=60)
            time.sleep(rng.uniform(0.001, 0.008))  # the behaviour: "work" while holding the token
            client.release()
            time.sleep(rng.uniform(0.0, 0.004))  # ...and a random pause before asking again
        print("DONE", flush=True)
        return 0
    if mode == "once":
        log = rest[0]
        client = _client(arena_dir, backend, model)
        req = client.request(timeout=60)
        while req.ticket is None and not req.done():  # a poll on the condition, not a delay
            time.sleep(0.001)
        print(f"TICKET {req.ticket.name if req.ticket else ''}", flush=True)
        grant = req.result()
        EventLog(log, model).record("order", grant.acquired_at, grant.acquired_at)
        time.sleep(0.02)  # the behaviour: a short turn with the token, as a decode would take
        client.release()
        print("DONE", flush=True)
        return 0
    if mode == "busy":
        log, n_turns, quantum = rest[0], int(rest[1]), float(rest[2]) / 1000.0
        client = _client(arena_dir, backend, model, log)
        rang = threading.Event()

        def on_waiter(ring: DoorbellRing) -> None:
            rang.set()

        client.start_doorbell(on_waiter)
        for _ in range(n_turns):
            grant = client.acquire(timeout=60)
            alone_until = grant.acquired_at + 2.0  # nobody rang: the turn ends anyway (a bound)
            while time.monotonic() < alone_until:  # "decode" until asked to yield after the quantum
                time.sleep(0.002)  # the behaviour: one "decode step"
                if rang.is_set() and time.monotonic() - grant.acquired_at >= quantum:
                    break
            rang.clear()
            client.release()
        client.close()
        print(f"TURNS {n_turns}", flush=True)
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
