"""The pool's bounds on failures (issue 26): a request whose worker dies while loading, again and
again, fails after LOAD_TRIES loads with the reason, even when the deaths are spread wider than
the restart window (before: re-queued for ever; one waited minutes in a chaos soak); a model that
failed for a full disk starts again on its own once the disk has room (before: failed until
someone ran start), and says so in its status meanwhile."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
from _proc_util import wait_until
from timeshare.core.config.schema import Config, ModelConfig
from timeshare.core.errors import ModelUnavailableError
from timeshare.core.pool import supervisor as pool_handlers
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState

WAIT = 120.0


def test_a_request_whose_worker_dies_while_loading_fails_after_bounded_tries(
    tmp_path: Path, smollm2_path: Path
) -> None:
    died = tmp_path / "deaths"
    # a worker that dies before it says Hello (a kill -9 during the load), counting its deaths
    argv = [sys.executable, "-c", f"open({str(died)!r}, 'a').write('x'); raise SystemExit(9)"]
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path)),))
    pool = Pool(
        config,
        arena_dir=tmp_path / "arena",
        restart_backoff_s=0.01,
        max_restarts=10**6,  # the restart budget never runs out here: only the request's bound ends it
        restart_window_s=0.001,
        worker_argv=argv,
    )
    pool.start()
    try:
        gen = pool.generate("m", prompt="hello", sampling=Sampling(max_tokens=4))
        with pytest.raises(ModelUnavailableError) as caught:
            gen.result(timeout=WAIT)
        message = str(caught.value)
        assert f"died {pool_handlers.LOAD_TRIES} times while loading for this request" in message
        assert "exit status 9" in message and "worker-m.log" in message
        assert len(died.read_text()) >= pool_handlers.LOAD_TRIES
    finally:
        pool.stop()


def test_a_model_failed_for_a_full_disk_starts_on_its_own_once_there_is_room(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_spawn = pool_handlers.spawn_worker
    spawns = {"n": 0}
    disk = {"full": True, "looks": 0}

    def spawn(*args: object, **kwargs: object) -> object:
        spawns["n"] += 1
        if spawns["n"] == 1:  # the log file cannot be written: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_spawn(*args, **kwargs)  # type: ignore[arg-type]

    def free_bytes(folder: Path) -> int:  # a fake statvfs: no room until the test frees some
        disk["looks"] += 1
        return 0 if disk["full"] else 10**9

    monkeypatch.setattr(pool_handlers, "spawn_worker", spawn)
    monkeypatch.setattr(pool_handlers, "free_bytes", free_bytes)
    monkeypatch.setattr(pool_handlers, "DISK_RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(pool_handlers, "DISK_RETRY_MAX_S", 0.05)
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path)),))
    never_hello = [sys.executable, "-c", "import time; time.sleep(600)"]
    pool = Pool(config, arena_dir=tmp_path / "arena", worker_argv=never_hello)
    pool.start()
    try:
        wait_until(lambda: disk["looks"] >= 3, WAIT, "a few looks at the full disk")
        status = pool.snapshot().model("m")
        assert status is not None and status.state is ModelState.FAILED
        assert "No space left on device" in status.reason and "on its own once there is room" in status.reason
        assert spawns["n"] == 1  # no start while the disk is full
        with pytest.raises(ModelUnavailableError, match="on its own"):
            pool.generate("m", prompt="hi", sampling=Sampling(max_tokens=2)).result(timeout=WAIT)
        disk["full"] = False  # space is back: no `timeshare start` needed
        wait_until(lambda: pool.snapshot().model("m").pid is not None, WAIT, "the worker to start")  # type: ignore[union-attr]
        assert pool.snapshot().model("m").state is ModelState.STARTING  # type: ignore[union-attr]
        assert spawns["n"] == 2
    finally:
        pool.stop()
