"""The pool's bounds on failures (issue 26): a request whose worker dies while loading, again and
again, fails after LOAD_TRIES loads with the reason, even when the deaths are spread wider than
the restart window (before: re-queued for ever; one waited minutes in a chaos soak)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from timeshare.core.config.schema import Config, ModelConfig
from timeshare.core.errors import ModelUnavailableError
from timeshare.core.pool import supervisor as pool_handlers
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling

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
