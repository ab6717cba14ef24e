"""Continuous batching through real processes (issue 24): a worker yields the GPU in the middle of a
batch of three and all three answers are still the solo answers after the restore; a pool sends up
to ``parallel`` requests to one worker, which answers them together; a worker killed with three in
flight fails each that had streamed part of its answer and sends again the one it had not started."""

from __future__ import annotations

# isort: off
import llama_cpp  # noqa: F401  (before anything that imports numpy)
# isort: on

import os
import signal
import threading
from pathlib import Path

import pytest
from _e_worker_util import WorkerHandle, generate_message
from _llama_oracle import plain_completions
from _proc_util import alive
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig
from timeshare.core.errors import ModelUnavailableError
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.wire import protocol as p

pytestmark = pytest.mark.slow

PROMPTS = (
    "The three primary colours are",
    "Count from one to fifty: one, two, three,",
    "Les capitales européennes les plus connues sont",
)
N = 40
N_CTX = 512
WAIT = 180.0  # a hang guard for a 2-core machine; nothing is timed


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> list[str]:
    """What a fresh plain Llama answers alone (create_completion, greedy), one per prompt."""
    return plain_completions(smollm2_path, PROMPTS, N, n_ctx=N_CTX)


def test_a_gpu_switch_in_the_middle_of_a_batch_of_three(
    smollm2_path: Path, gemma3_path: Path, tmp_path: Path, handles: list[WorkerHandle], reference: list[str]
) -> None:
    arena_dir = tmp_path / "arena"
    arena = ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT)
    a = WorkerHandle(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=N_CTX, parallel=3),
        tmp_path / "a",
        arena_dir=arena_dir,
        arena=arena,
    )
    handles.append(a)
    assert a.ready().info.parallel == 3
    b = WorkerHandle(
        ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=256),
        tmp_path / "b",
        arena_dir=arena_dir,
        arena=arena,
    )
    handles.append(b)
    b.ready()
    for i, prompt in enumerate(PROMPTS):
        a.send(generate_message(f"a{i}", prompt=prompt, max_tokens=N, cache_prompt=False))
    # once all three stream, the other model wants the GPU: a yields between two steps
    seen: dict[str, int] = {}
    while len(seen) < 3 or min(seen.values()) < 3:
        msg = a.expect((p.Token, p.WorkerStatus, p.Released))
        if isinstance(msg, p.Token):
            seen[msg.req] = seen.get(msg.req, 0) + 1
        assert not isinstance(msg, p.Done), msg
    b.send(generate_message("b0", prompt="The capital of France is", max_tokens=4))
    done: dict[str, p.Done] = {}
    released_mid_batch: list[p.Released] = []
    while len(done) < 3:
        msg = a.expect((p.Token, p.Done, p.Error, p.Released, p.WorkerStatus))
        assert not isinstance(msg, p.Error), msg
        if isinstance(msg, p.Done):
            done[msg.req] = msg
        elif isinstance(msg, p.Released) and not done:
            released_mid_batch.append(msg)
    _, b_done = b.collect("b0")
    assert isinstance(b_done, p.Done) and b_done.switch.switched
    assert released_mid_batch  # the weights left in the middle of the batch ...
    # ... first for b, whose Done says how long that took, as a measured it (carried with the token;
    # a may give the GPU way again later in the batch, when b asks for it again)
    assert b_done.switch.release_ms == released_mid_batch[0].release_ms > 0
    # ... and every sequence went on after the restore as if nothing happened
    for i in range(3):
        assert done[f"a{i}"].finish_reason == "length" and done[f"a{i}"].batch_size == 3
    streamed = {r: "".join(m.text for m in a.seen if isinstance(m, p.Token) and m.req == r) for r in done}
    assert [streamed[f"a{i}"] for i in range(3)] == reference


def test_a_pool_answers_parallel_requests_together_and_a_crash_treats_each_on_its_own(
    smollm2_path: Path, tmp_path: Path, reference: list[str]
) -> None:
    config = Config(
        models=(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=N_CTX, parallel=3, idle_sleep_s=None),),
        arena=ArenaConfig(wait_timeout_s=WAIT),
        api=ApiConfig(queue_limit=8),
    )
    pool = Pool(config, arena_dir=tmp_path / "arena", log_dir=tmp_path / "log", kv_dir=tmp_path / "kv")
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        # three at once: one batch, the solo answers
        gens = [
            pool.generate("smol", prompt=q, sampling=Sampling(max_tokens=N), cache_prompt=False)
            for q in PROMPTS
        ]
        results = [g.result(timeout=WAIT) for g in gens]
        assert [r.text for r in results] == reference
        assert max(r.batch_size for r in results) == 3
        status = pool.snapshot().model("smol")
        assert status is not None and status.parallel == 3 and status.active == 0
        # three in flight: two answering, one waiting for its conversation (never decoded twice at
        # once), then the worker is killed
        first = pool.generate(
            "smol", prompt=PROMPTS[1], sampling=Sampling(max_tokens=2000), conversation="c", cache_prompt=None
        )
        other = pool.generate(
            "smol", prompt=PROMPTS[2], sampling=Sampling(max_tokens=2000), cache_prompt=False
        )
        second = pool.generate(
            "smol", prompt=PROMPTS[0], sampling=Sampling(max_tokens=8), conversation="c", cache_prompt=None
        )
        streams = [iter(first), iter(other)]
        for s in streams:
            next(s)  # both answering
        before = pool.snapshot().model("smol")
        assert before is not None and before.pid and before.active == 2
        os.kill(before.pid, signal.SIGKILL)
        for g in (first, other):
            with pytest.raises(
                ModelUnavailableError, match=r"crashed while answering \(\d+ characters streamed\)"
            ):
                g.result(timeout=WAIT)
        # the one that had not started is answered by the restarted worker
        assert second.result(timeout=WAIT).text
        after = pool.snapshot().model("smol")
        assert after is not None and after.restarts == 1 and after.pid != before.pid
        assert not alive(before.pid)
    finally:
        pool.stop()


def test_four_concurrent_callers_of_a_pool_get_the_solo_answers(smollm2_path: Path, tmp_path: Path) -> None:
    prompts = (*PROMPTS, "def fibonacci(n):\n")
    want = plain_completions(smollm2_path, prompts, 24, n_ctx=N_CTX)
    config = Config(
        models=(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=N_CTX, parallel=4, idle_sleep_s=None),),
        arena=ArenaConfig(wait_timeout_s=WAIT),
    )
    pool = Pool(config, arena_dir=tmp_path / "arena", log_dir=tmp_path / "log", kv_dir=tmp_path / "kv")
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        barrier = threading.Barrier(4)
        got: dict[int, str] = {}

        def caller(i: int) -> None:
            barrier.wait()
            gen = pool.generate(
                "smol", prompt=prompts[i], sampling=Sampling(max_tokens=24), cache_prompt=False
            )
            got[i] = "".join(gen)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert [got.get(i) for i in range(4)] == want
    finally:
        pool.stop()


def test_a_burst_of_four_is_prefilled_in_one_step(
    smollm2_path: Path, tmp_path: Path, handles: list[WorkerHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four requests reach the worker together, the last one's frame cut in two around a pause:
    # the worker takes what is still on its way before the first step (the unread half frame), so
    # the four prompts are prefilled in one llama_decode, as llama-server's slots do. The gather
    # cap is long here so that the pause (for the old loop, which started at once) is not a race.
    monkeypatch.setenv("TIMESHARE_BATCH_GATHER_MS", "60000")
    prompts = (*PROMPTS, "def fibonacci(n):\n")
    want = plain_completions(smollm2_path, prompts, 8, n_ctx=N_CTX)
    w = WorkerHandle(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=N_CTX, parallel=4), tmp_path / "w")
    handles.append(w)
    w.ready()
    names = tuple(f"r{i}" for i in range(4))
    frames = b"".join(
        p.encode(generate_message(name, prompt=q, max_tokens=8, cache_prompt=False))
        for name, q in zip(names, prompts, strict=True)
    )
    w.send_bytes(frames[:-16], names)
    threading.Event().wait(0.5)  # the worker has the first three and half of the fourth
    w.send_bytes(frames[-16:])
    answers = [w.collect(name, WAIT) for name in names]
    assert [text for text, _done in answers] == want
    for _text, done in answers:
        assert isinstance(done, p.Done) and done.timings is not None, done
        t = done.timings
        assert (t.steps_before, t.prefill_steps, t.step_prompts, t.step_sequences) == (0, 1, 4, 4), t
        assert t.first_token_ms >= t.queue_ms + t.prefill_ms > 0, t
        assert done.batch_size == 4
