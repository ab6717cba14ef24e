"""The pool with real worker processes on the two demo models (and broken model files).

One module-scoped pool serves most tests (starting workers is the expensive part); tests that
need their own pool (restart budget, escalation to SIGKILL, unsafe arena) start a small one.
Nothing here asserts on time: switches and prefill are checked through the workers' counters.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _proc_util import alive, proc_state
from timeshare.core.config import validate as config_validate
from timeshare.core.config.demo import GEMMA3_ID, SMOLLM2_ID
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig
from timeshare.core.errors import (
    ArenaError,
    ConfigError,
    ModelUnavailableError,
    PromptTooLongError,
    QueueFullError,
    UnknownModelError,
)
from timeshare.core.pool import process as pool_process
from timeshare.core.pool.generation import Generation
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import EventKind, ModelState, PoolEvent

pytestmark = pytest.mark.slow
_SERVING = (ModelState.RESIDENT, ModelState.RELEASED, ModelState.SLEEPING)

PROMPTS = {
    SMOLLM2_ID: "The capital of France is",
    GEMMA3_ID: "One, two, three, four,",
}
N_TOKENS = 12
WAIT = 120.0  # generous bound for a 2-core CI machine; nothing is timed


class Events:
    """Collects pool events (from the pool's event thread) and waits for one that matches."""

    def __init__(self) -> None:
        self.items: list[PoolEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: PoolEvent) -> None:
        with self._cond:
            self.items.append(event)
            self._cond.notify_all()

    def mark(self) -> int:
        with self._cond:
            return len(self.items)

    def wait_for(self, pred: Callable[[PoolEvent], bool], since: int = 0, timeout: float = WAIT) -> PoolEvent:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.items[since:]:
                    if pred(event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0:
                    kinds = [(e.kind.value, e.model, e.message) for e in self.items[since:]][-20:]
                    raise AssertionError(f"no matching pool event; last events: {kinds}")
                self._cond.wait(left)


def state_is(model: str, *states: ModelState) -> Callable[[PoolEvent], bool]:
    def pred(event: PoolEvent) -> bool:
        status = event.snapshot.model(model)
        return status is not None and status.state in states

    return pred


def _all_gone(pids: list[int]) -> bool:
    """Whether every process is gone; a SIGKILLed process may need a moment to be scheduled and die."""
    deadline = time.monotonic() + 10.0
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(smollm2_path: Path, gemma3_path: Path) -> dict[str, str]:
    """Greedy completions from plain llama-cpp-python, the answers the pool must reproduce."""
    from _llama_oracle import plain_completions  # llama_cpp: only in this fixture

    return {
        model_id: plain_completions(path, (PROMPTS[model_id],), N_TOKENS)[0]
        for model_id, path in ((SMOLLM2_ID, smollm2_path), (GEMMA3_ID, gemma3_path))
    }


@pytest.fixture(scope="module")
def broken_files(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("broken")
    missing = d / "missing.gguf"
    not_gguf = d / "notes.gguf"
    not_gguf.write_text("this is a text file, not a model\n")
    truncated = d / "truncated.gguf"  # header intact, half of the tensor data missing
    damaged = d / "damaged.gguf"  # cut inside the metadata
    data = smollm2_path.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    damaged.write_bytes(data[: 1 << 20])
    return {"missing": missing, "not-gguf": not_gguf, "truncated": truncated, "damaged": damaged}


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("pool-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIMESHARE_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def shared(
    module_home: Path, smollm2_path: Path, gemma3_path: Path, broken_files: dict[str, Path]
) -> Iterator[tuple[Pool, Events]]:
    config = Config(
        models=(
            ModelConfig(id=SMOLLM2_ID, path=str(smollm2_path), idle_sleep_s=None, licence="Apache-2.0"),
            ModelConfig(id=GEMMA3_ID, path=str(gemma3_path), idle_sleep_s=None),
            ModelConfig(id="missing", path=str(broken_files["missing"])),
            ModelConfig(id="not-gguf", path=str(broken_files["not-gguf"])),
            ModelConfig(id="truncated", path=str(broken_files["truncated"])),
            ModelConfig(id="damaged", path=str(broken_files["damaged"])),
        ),
        arena=ArenaConfig(min_quantum_ms=2000.0, wait_timeout_s=120.0),  # few switches per request
        api=ApiConfig(queue_limit=2),
    )
    pool = Pool(
        config, arena_dir=module_home / "arena", log_dir=module_home / "log", kv_dir=module_home / "kv"
    )
    events = Events()
    pool.subscribe(events)
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        yield pool, events
    finally:
        pids = [m.pid for m in pool.snapshot().models if m.pid]
        pool.stop()
        assert not [p for p in pids if alive(p) or group_alive(p)], "worker processes left behind"


def complete(pool: Pool, model: str, prompt: str | None = None, **kw: object) -> tuple[str, Generation]:
    gen = pool.generate(model, prompt=prompt or PROMPTS[model], **kw, sampling=Sampling(max_tokens=N_TOKENS))  # type: ignore[arg-type]
    streamed = "".join(gen)
    return streamed, gen


# ---- no worker needed ----------------------------------------------------------------------


def test_worker_log_is_rotated_and_its_tail_read(tmp_path: Path) -> None:
    log = tmp_path / "worker-m.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert pool_process.read_log_tail(log, 3) == ("line 97", "line 98", "line 99")
    pool_process._rotate_log(log, limit=10)
    assert not log.exists() and (tmp_path / "worker-m.log.1").exists()
    assert pool_process.read_log_tail(log) == ()


def test_clean_env_keeps_only_the_whitelist() -> None:
    env = pool_process.clean_env(
        {
            "PATH": "/bin",
            "HOME": "/h",
            "LC_ALL": "C",
            "CUDA_VISIBLE_DEVICES": "0",
            "TIMESHARE_HOME": "/t",
            "PYTHONPATH": "/evil",
            "LD_PRELOAD": "x.so",
            "AWS_SECRET_ACCESS_KEY": "s",
        }
    )
    assert env == {
        "PATH": "/bin",
        "HOME": "/h",
        "LC_ALL": "C",
        "CUDA_VISIBLE_DEVICES": "0",
        "TIMESHARE_HOME": "/t",
    }


_REFUSED = [
    (  # the same id twice
        {"models": [{"id": "a", "path": "x.gguf"}, {"id": "a", "path": "y.gguf"}]},
        Config(models=(ModelConfig(id="a", path="x.gguf"), ModelConfig(id="a", path="y.gguf"))),
        r"models\[1\]\.id: 'a' is already used by models\[0\]",
    ),
    ({"api": {"queue_limit": 0}}, Config(api=ApiConfig(queue_limit=0)), r"api\.queue_limit: must be > 0"),
    (
        {"models": [{"id": "a", "path": ""}]},
        Config(models=(ModelConfig(id="a", path=""),)),
        r"models\[0\]\.path: must not be empty",
    ),
    (
        {"models": [{"id": "a", "path": "x.gguf", "idle_release": "never"}]},
        Config(models=(ModelConfig(id="a", path="x.gguf", idle_release="never"),)),  # type: ignore[arg-type]
        r"models\[0\]\.idle_release: must be one of",
    ),
    (
        {"models": [{"id": "My Model", "path": "x.gguf"}]},
        Config(models=(ModelConfig(id="My Model", path="x.gguf"),)),
        r"models\[0\]\.id: 'My Model' may contain only",
    ),
]


@pytest.mark.parametrize(("raw", "config", "problem"), _REFUSED)
def test_the_pool_refuses_what_the_config_layer_refuses(
    raw: dict[str, object], config: Config, problem: str
) -> None:
    """The config layer validates (there is no check of the pool's own): a Config built in code
    is checked the same way when a Pool is made or given a new configuration."""
    with pytest.raises(ConfigError, match=problem) as by_config_layer:
        config_validate.validate(raw, check_paths=False)
    with pytest.raises(ConfigError, match=problem) as by_pool:
        Pool(config)
    assert by_pool.value.problems == by_config_layer.value.problems
    pool = Pool(Config())
    with pytest.raises(ConfigError, match=problem):
        pool.apply_config(config)


def test_unsafe_arena_fails_start_and_spawns_nothing(tmp_path: Path, smollm2_path: Path) -> None:
    arena = tmp_path / "arena"
    arena.mkdir()
    arena.chmod(0o777)
    pool = Pool(Config(models=(ModelConfig(id="m", path=str(smollm2_path)),)), arena_dir=arena)
    with pytest.raises(ArenaError, match=re.escape(str(arena))):
        pool.start()
    assert pool.snapshot().models == ()
    with pytest.raises(ModelUnavailableError, match="not running"):
        pool.generate("m", prompt="hi")
    pool.stop()  # harmless


def test_generate_arguments_are_checked(tmp_path: Path) -> None:
    pool = Pool(Config())
    with pytest.raises(ValueError, match="exactly one of prompt"):
        pool.generate("m", prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="role system/user/assistant"):
        pool.generate("m", messages=[{"role": "robot", "content": "b"}])
    with pytest.raises(ValueError, match="max_tokens"):
        pool.generate("m", prompt="a", sampling=Sampling(max_tokens=0))


# ---- the shared pool -----------------------------------------------------------------------


def test_broken_models_fail_with_a_reason_while_the_others_serve(shared: tuple[Pool, Events]) -> None:
    pool, events = shared
    snap = pool.snapshot()
    missing, not_gguf, truncated = snap.model("missing"), snap.model("not-gguf"), snap.model("truncated")
    assert missing and not_gguf and truncated
    assert missing.state is ModelState.FAILED and "does not exist" in missing.reason
    assert not_gguf.state is ModelState.FAILED and "not a GGUF file" in not_gguf.reason
    assert truncated.state is ModelState.FAILED and "is truncated" in truncated.reason, truncated
    assert "re-download it" in truncated.reason
    damaged = snap.model("damaged")
    assert damaged and damaged.state is ModelState.FAILED and "damaged GGUF" in damaged.reason, damaged
    assert truncated.restarts == damaged.restarts == 0  # a load failure is not retried in a loop
    assert any("truncated" in line for line in truncated.log_tail)  # the worker's log is kept
    for model_id in ("missing", "not-gguf", "truncated", "damaged"):
        events.wait_for(lambda e, m=model_id: e.kind is EventKind.FAILED and e.model == m)
        with pytest.raises(ModelUnavailableError, match="not available"):
            pool.generate(model_id, prompt="hi")
    with pytest.raises(UnknownModelError, match=r"configured models: .*smollm2"):
        pool.generate("nope", prompt="hi")
    for model_id in (SMOLLM2_ID, GEMMA3_ID):
        status = snap.model(model_id)
        assert status is not None and status.state in (ModelState.RESIDENT, ModelState.RELEASED)
        assert status.pid and status.n_ctx == 2048 and status.chat_format in ("template", "fallback")
    assert snap.model(SMOLLM2_ID).licence == "Apache-2.0"  # type: ignore[union-attr]


def test_alternating_models_stream_correct_answers_and_switch(
    shared: tuple[Pool, Events], reference: dict[str, str]
) -> None:
    pool, events = shared
    mark = events.mark()
    switched = 0
    for model in (SMOLLM2_ID, GEMMA3_ID, SMOLLM2_ID, GEMMA3_ID):
        streamed, gen = complete(pool, model)
        result = gen.result(timeout=WAIT)
        assert streamed == result.text == reference[model], model
        assert result.finish_reason == "length" and result.usage.completion_tokens == N_TOKENS
        switched += result.switch.switched
        if result.switch.switched:
            assert result.switch.restore_ms > 0 and result.switch.first_token_ms > 0
        assert pool.snapshot().holder == model  # the worker reported holds_token before Done
    assert switched >= 3  # every request after the first had to take the GPU from the other
    last_req = gen.req
    events.wait_for(lambda e: e.kind is EventKind.REQUEST_DONE and e.extra.get("req") == last_req, mark)
    for model in (SMOLLM2_ID, GEMMA3_ID):  # busy, then idle, was visible for each
        assert any(e.snapshot.model(model).busy for e in events.items[mark:])  # type: ignore[union-attr]
        assert not events.items[-1].snapshot.model(model).busy  # type: ignore[union-attr]
    done = [e for e in events.items[mark:] if e.kind is EventKind.REQUEST_DONE]
    assert len(done) == 4 and all(e.switch is not None for e in done)
    # each request after the first took the GPU from the other model, and says how long that
    # one's release took (carried with the token; the first may find the GPU free: nothing to say)
    assert all(e.switch.switched and e.switch.release_ms > 0 for e in done[1:] if e.switch), [
        (e.model, e.switch) for e in done
    ]


def test_concurrent_requests_for_both_models_queue_and_share_the_gpu(
    shared: tuple[Pool, Events], reference: dict[str, str]
) -> None:
    pool, _ = shared
    start = threading.Barrier(4)
    answers: dict[int, tuple[str, str]] = {}
    problems: list[BaseException] = []

    def client(i: int, model: str) -> None:
        try:
            start.wait()
            streamed, _ = complete(pool, model)
            answers[i] = (model, streamed)
        except BaseException as exc:
            problems.append(exc)

    threads = [
        threading.Thread(target=client, args=(i, (SMOLLM2_ID, GEMMA3_ID)[i % 2])) for i in range(4)
    ]  # two per model, sent at once: each model queues its own, the arena alternates the GPU
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not problems
    assert len(answers) == 4 and all(text == reference[model] for model, text in answers.values())


def test_conversation_continued_after_a_switch_is_not_prefilled_again(shared: tuple[Pool, Events]) -> None:
    pool, _ = shared
    conv = "conv-switch"
    history = [{"role": "user", "content": "Name a colour."}]
    first = pool.generate(
        SMOLLM2_ID, messages=history, conversation=conv, sampling=Sampling(max_tokens=8)
    ).result(timeout=WAIT)
    assert first.usage.prompt_tokens_evaluated == first.usage.prompt_tokens > 0
    other = pool.generate(GEMMA3_ID, prompt=PROMPTS[GEMMA3_ID], sampling=Sampling(max_tokens=4)).result(
        timeout=WAIT
    )
    assert other.text
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Another one?"}]
    second = pool.generate(
        SMOLLM2_ID, messages=history, conversation=conv, sampling=Sampling(max_tokens=8)
    ).result(timeout=WAIT)
    assert second.switch.switched
    # only the new turn was prefilled, not the conversation so far
    # (a full re-prefill would evaluate all of second.usage.prompt_tokens)
    assert 0 < second.usage.prompt_tokens_evaluated <= second.usage.prompt_tokens - first.usage.prompt_tokens


def test_prompt_longer_than_context_is_a_clear_error_and_the_model_keeps_serving(
    shared: tuple[Pool, Events], reference: dict[str, str]
) -> None:
    pool, _ = shared
    gen = pool.generate(SMOLLM2_ID, prompt="hello " * 3000, sampling=Sampling(max_tokens=4))
    with pytest.raises(PromptTooLongError):
        gen.result(timeout=WAIT)
    with pytest.raises(PromptTooLongError):
        list(gen)
    streamed, gen = complete(pool, SMOLLM2_ID)
    assert streamed == reference[SMOLLM2_ID]
    # stop strings end the answer early
    stopped = pool.generate(
        SMOLLM2_ID, prompt=PROMPTS[SMOLLM2_ID], sampling=Sampling(max_tokens=N_TOKENS, stop=["."])
    )
    result = stopped.result(timeout=WAIT)
    assert result.text == reference[SMOLLM2_ID].split(".")[0] and result.finish_reason == "stop"


def test_queue_limit_and_cancel(shared: tuple[Pool, Events], reference: dict[str, str]) -> None:
    pool, _ = shared
    parallel = pool.snapshot().model(GEMMA3_ID).parallel  # type: ignore[union-attr]
    assert parallel >= 1
    # the worker answers `parallel` at once (those in flight are not counted); a third waiting is refused
    long, *more = [
        pool.generate(GEMMA3_ID, prompt="Once upon a time", sampling=Sampling(max_tokens=2000))
        for _ in range(parallel)
    ]
    queued = [
        pool.generate(GEMMA3_ID, prompt=PROMPTS[GEMMA3_ID], sampling=Sampling(max_tokens=N_TOKENS))
        for _ in range(2)
    ]
    with pytest.raises(QueueFullError, match="queue_limit = 2"):
        pool.generate(GEMMA3_ID, prompt="one more")
    assert pool.snapshot().model(GEMMA3_ID).queued == 2  # type: ignore[union-attr]
    queued[0].cancel()
    assert queued[0].result(timeout=WAIT).finish_reason == "cancelled"
    next(iter(long))  # it is generating
    for gen in (long, *more):
        gen.cancel()
        assert gen.result(timeout=WAIT).finish_reason == "cancelled"
    assert queued[1].result(timeout=WAIT).text == reference[GEMMA3_ID]  # served after the cancel


def test_pin_sleep_wake_stop_are_visible_in_events(
    shared: tuple[Pool, Events], reference: dict[str, str]
) -> None:
    pool, events = shared
    m = SMOLLM2_ID

    mark = events.mark()
    pool.pin(m, True)
    events.wait_for(lambda e: bool(e.snapshot.model(m) and e.snapshot.model(m).pinned), mark)  # type: ignore[union-attr]
    pool.pin(m, False)
    events.wait_for(lambda e: bool(e.snapshot.model(m) and not e.snapshot.model(m).pinned), mark)  # type: ignore[union-attr]

    mark = events.mark()
    pool.wake(m)
    events.wait_for(state_is(m, ModelState.RESIDENT), mark)
    assert pool.snapshot().holder == m

    # pinned and resident: a request for the other model waits, and the snapshot says why
    mark = events.mark()
    pool.pin(m, True)
    waiting = pool.generate(GEMMA3_ID, prompt=PROMPTS[GEMMA3_ID], sampling=Sampling(max_tokens=N_TOKENS))
    event = events.wait_for(
        lambda e: f"pinned by {m}" in (e.snapshot.model(GEMMA3_ID).reason or ""),  # type: ignore[union-attr]
        mark,
    )
    assert event.snapshot.holder == m and not waiting.done
    pool.pin(m, False)  # the waiter gets the GPU at the next token boundary
    assert waiting.result(timeout=WAIT).text == reference[GEMMA3_ID]
    assert waiting.result().switch.switched

    mark = events.mark()
    pool.sleep(m, "weights+kv")
    events.wait_for(state_is(m, ModelState.SLEEPING), mark)

    mark = events.mark()
    pool.wake(m)
    events.wait_for(state_is(m, ModelState.RESIDENT), mark)

    # stop keeps the conversation: the worker saves its KV and the next one restores it
    conv = "conv-stop"
    history = [{"role": "user", "content": "Say hello."}]
    first = pool.generate(m, messages=history, conversation=conv, sampling=Sampling(max_tokens=6)).result(
        timeout=WAIT
    )
    pid = pool.snapshot().model(m).pid  # type: ignore[union-attr]
    assert pid
    mark = events.mark()
    pool.stop_model(m)
    events.wait_for(state_is(m, ModelState.STOPPED), mark)
    assert not alive(pid)
    assert pool.snapshot().model(m).pid is None  # type: ignore[union-attr]

    mark = events.mark()
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Again."}]
    gen = pool.generate(
        m, messages=history, conversation=conv, sampling=Sampling(max_tokens=6)
    )  # starts it on demand
    events.wait_for(state_is(m, ModelState.STARTING, ModelState.LOADING), mark)
    second = gen.result(timeout=WAIT)
    assert second.text
    assert 0 < second.usage.prompt_tokens_evaluated <= second.usage.prompt_tokens - first.usage.prompt_tokens
    new_pid = pool.snapshot().model(m).pid  # type: ignore[union-attr]
    assert new_pid and new_pid != pid
    assert complete(pool, m)[0] == reference[m]


def test_crash_restarts_the_worker_and_the_conversation_continues(
    shared: tuple[Pool, Events], reference: dict[str, str]
) -> None:
    pool, events = shared
    m = GEMMA3_ID
    history = [{"role": "user", "content": "Count to twenty."}]
    before = pool.snapshot().model(m)
    assert before is not None and before.pid
    mark = events.mark()
    answering = pool.generate(m, prompt="Once upon a time", sampling=Sampling(max_tokens=2000))
    waiting = pool.generate(m, messages=history, conversation="conv-crash", sampling=Sampling(max_tokens=8))
    next(iter(answering))  # mid-answer
    os.kill(before.pid, signal.SIGKILL)
    crashed_while = r"crashed while answering \(\d+ characters streamed\); it is being restarted"
    with pytest.raises(ModelUnavailableError, match=crashed_while):
        answering.result(timeout=WAIT)
    crashed = events.wait_for(lambda e: e.kind is EventKind.CRASHED and e.model == m, mark)
    assert crashed.extra["exit_code"] == -signal.SIGKILL
    events.wait_for(lambda e: e.kind is EventKind.RESTARTED and e.model == m, mark)
    # the queued request was kept and is served by the new worker
    assert waiting.result(timeout=WAIT).text
    after = pool.snapshot().model(m)
    assert after is not None and after.restarts == before.restarts + 1 and after.pid != before.pid
    assert complete(pool, m)[0] == reference[m]


# ---- pools of their own --------------------------------------------------------------------


def test_restart_budget_spent_marks_the_model_failed_with_its_log(tmp_path: Path, smollm2_path: Path) -> None:
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path), idle_sleep_s=None),))
    pool = Pool(
        config, arena_dir=tmp_path / "arena", restart_backoff_s=0.05, max_restarts=1, restart_window_s=600
    )
    events = Events()
    pool.subscribe(events)
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        pid = pool.snapshot().model("m").pid  # type: ignore[union-attr]
        assert pid
        os.kill(pid, signal.SIGKILL)
        events.wait_for(lambda e: e.kind is EventKind.RESTARTED)
        pid2 = pool.snapshot().model("m").pid  # type: ignore[union-attr]
        assert pid2 and pid2 != pid
        os.kill(pid2, signal.SIGKILL)
        failed = events.wait_for(lambda e: e.kind is EventKind.FAILED)
        status = failed.snapshot.model("m")
        assert status is not None and status.state is ModelState.FAILED
        assert "crashed 2 times" in status.reason and "start it again" in status.reason
        assert any("starting worker for m" in line for line in status.log_tail)
        with pytest.raises(ModelUnavailableError, match="crashed 2 times"):
            pool.generate("m", prompt="hi")
        pool.start_model("m")  # the user fixed it: a fresh budget
        pool.wait_ready(timeout=WAIT)
        assert pool.snapshot().model("m").state in (ModelState.RESIDENT, ModelState.RELEASED)  # type: ignore[union-attr]
    finally:
        pool.stop()


def test_every_switch_reports_the_release_of_the_worker_it_followed(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool]
) -> None:
    """The demo model twice on a one-model budget, asked in turn: every request after the first
    takes the GPU from the other, whose release time its Done carries (through the arena, with
    the token), equal to what that worker itself reported in its Released: the last n releases
    of a model are the ones the other's last n switches followed (the earlier ones made room for
    the loads, or gave the GPU back after them), whatever order the two workers' messages reached
    the pool in."""
    models = ("smol-a", "smol-b")
    config = Config(
        models=tuple(ModelConfig(id=m, path=str(smollm2_path), n_ctx=256, idle_sleep_s=None) for m in models),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget="one-model"),
    )
    pool = Pool(config, arena_dir=tmp_path / "arena", log_dir=tmp_path / "log", kv_dir=tmp_path / "kv")
    pools.append(pool)
    events = Events()
    pool.subscribe(events)
    pool.start()
    pool.wait_ready(timeout=WAIT)
    turns = [models[i % 2] for i in range(6)]
    switches: dict[str, list[float]] = {m: [] for m in models}  # release_ms of each switch to m
    in_order: list[float] = []  # the same, in the turns' order
    for i, model in enumerate(turns):
        gen = pool.generate(model, prompt=PROMPTS[SMOLLM2_ID], sampling=Sampling(max_tokens=2))
        result = gen.result(timeout=WAIT)
        if i == 0 and result.switch.release_ms == 0.0:
            continue  # the GPU was free (each worker gives it back after its load): nobody released
        assert result.switch.switched and result.switch.release_ms > 0, (i, model, result.switch)
        switches[model].append(result.switch.release_ms)
        in_order.append(result.switch.release_ms)

    def releases(model: str) -> list[float]:  # the worker's own Released figures, in its order
        return [
            float(e.extra["release_ms"])  # type: ignore[arg-type]
            for e in list(events.items)
            if e.kind is EventKind.MESSAGE
            and e.model == model
            and "level" in e.extra
            and "release_ms" in e.extra
        ]

    other = {models[0]: models[1], models[1]: models[0]}
    deadline = time.monotonic() + WAIT  # a Released may reach the pool after the Done it preceded
    while any(len(releases(other[m])) < len(switches[m]) for m in models):
        assert time.monotonic() < deadline, {m: (releases(m), switches[m]) for m in models}
        time.sleep(0.05)
    for model in models:
        theirs = releases(other[model])
        assert switches[model] == theirs[len(theirs) - len(switches[model]) :], (model, switches, theirs)
    # the pool's events and the model's last switch say the same figures, in the turns' order
    last_req = gen.req
    events.wait_for(lambda e: e.kind is EventKind.REQUEST_DONE and e.extra.get("req") == last_req)
    done = [e.switch for e in events.items if e.kind is EventKind.REQUEST_DONE and e.switch is not None]
    assert [x.release_ms for x in done if x.switched and x.release_ms > 0] == in_order
    assert pool.snapshot().model(turns[-1]).last_switch.release_ms == in_order[-1]  # type: ignore[union-attr]


def test_stop_kills_a_worker_that_does_not_answer(tmp_path: Path, smollm2_path: Path) -> None:
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path), idle_sleep_s=None),))
    pool = Pool(config, arena_dir=tmp_path / "arena", stop_grace_s=0.5)
    pool.start()
    pool.wait_ready(timeout=WAIT)
    pid = pool.snapshot().model("m").pid  # type: ignore[union-attr]
    assert pid
    os.kill(pid, signal.SIGSTOP)  # it can no longer read Shutdown nor handle SIGTERM
    pool.stop(timeout=1.0)
    assert not alive(pid) and not group_alive(pid)


def test_idle_timer_applies_each_models_release_level(tmp_path: Path, smollm2_path: Path) -> None:
    def model(model_id: str, level: str) -> ModelConfig:
        return ModelConfig(id=model_id, path=str(smollm2_path), idle_sleep_s=0.3, idle_release=level)  # type: ignore[arg-type]

    config = Config(models=(model("w", "weights"), model("kv", "weights+kv"), model("stop", "stop")))
    pool = Pool(config, arena_dir=tmp_path / "arena")
    events = Events()
    pool.subscribe(events)
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        # "weights": only a resident model has something to release
        mark = events.mark()
        assert pool.generate("w", prompt="Hi", sampling=Sampling(max_tokens=2)).result(timeout=WAIT).text
        events.wait_for(
            lambda e: e.model == "w" and "idle for 0.3 s: releasing its weights" in e.message, mark
        )
        events.wait_for(state_is("w", ModelState.RELEASED), mark)
        # "weights+kv": sleeps; "stop": the worker exits
        events.wait_for(lambda e: e.model == "kv" and "idle for 0.3 s: sleeping" in e.message)
        events.wait_for(state_is("kv", ModelState.SLEEPING))
        events.wait_for(lambda e: e.model == "stop" and "idle for 0.3 s: stopping" in e.message)
        events.wait_for(state_is("stop", ModelState.STOPPED))
        # a request brings the stopped one back
        assert (
            pool.generate("stop", prompt="Hi", sampling=Sampling(max_tokens=2))
            .result(timeout=WAIT)
            .usage.completion_tokens
            > 0
        )
    finally:
        pool.stop()


def test_apply_config_adds_removes_and_restarts_models(tmp_path: Path, smollm2_path: Path) -> None:
    a = ModelConfig(id="a", path=str(smollm2_path), idle_sleep_s=None)
    pool = Pool(Config(models=(a,)), arena_dir=tmp_path / "arena")
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        pid_a = pool.snapshot().model("a").pid  # type: ignore[union-attr]
        assert pid_a
        # a load-time field changed: "a" restarts with it; "b" is added (its file is missing)
        b = ModelConfig(id="b", path=str(tmp_path / "nowhere.gguf"))
        a_small = ModelConfig(id="a", path=str(smollm2_path), idle_sleep_s=None, n_ctx=1024)
        pool.apply_config(Config(models=(a_small, b)))
        deadline = time.monotonic() + WAIT
        while pool.snapshot().model("a").pid in (pid_a, None) and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        pool.wait_ready(timeout=WAIT)
        snap = pool.snapshot()
        assert not alive(pid_a)
        assert snap.model("a").n_ctx == 1024 and snap.model("a").state in _SERVING  # type: ignore[union-attr]
        assert snap.model("b").state is ModelState.FAILED  # type: ignore[union-attr]
        # "a" removed: its worker stops and the id is gone
        pid_a = snap.model("a").pid  # type: ignore[union-attr]
        pool.apply_config(Config(models=(b,)))
        while pool.snapshot().model("a") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.snapshot().model("a") is None and pid_a and not alive(pid_a)
        with pytest.raises(UnknownModelError):
            pool.generate("a", prompt="hi")
        # the file appears: starting the model again works
        shutil.copy(smollm2_path, tmp_path / "nowhere.gguf")
        pool.start_model("b")
        pool.wait_ready(["b"], timeout=WAIT)
        assert pool.snapshot().model("b").state in _SERVING  # type: ignore[union-attr]
    finally:
        pool.stop()


# ---- workers that misbehave (fault injection: the real worker never does this) ----------------

_GARBAGE_WORKER = """
import json, socket, struct, sys, time
sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--ipc-fd") + 1]))
hello = json.dumps({"v": 1, "type": "Hello", "pid": 0, "model_id": "g"}).encode()
sock.sendall(struct.pack(">I", len(hello)) + hello)
sock.sendall(struct.pack(">I", 5) + b'{"v":')  # bad JSON in an intact frame
sock.sendall(b"\\xff" * 64)  # a length over the limit: the stream cannot be resynced
print("garbage sent", file=sys.stderr, flush=True)
time.sleep(600)
"""


def test_a_worker_sending_garbage_is_killed_and_counted_as_a_crash(
    tmp_path: Path, smollm2_path: Path
) -> None:
    config = Config(models=(ModelConfig(id="g", path=str(smollm2_path)),))
    pool = Pool(
        config,
        arena_dir=tmp_path / "arena",
        worker_argv=[sys.executable, "-c", _GARBAGE_WORKER],
        max_restarts=0,
        stop_grace_s=0.5,
    )
    events = Events()
    pool.subscribe(events)
    pool.start()
    try:
        crashed = events.wait_for(lambda e: e.kind is EventKind.CRASHED)
        assert crashed.extra["exit_code"] == -signal.SIGKILL
        failed = events.wait_for(lambda e: e.kind is EventKind.FAILED)
        status = failed.snapshot.model("g")
        assert status is not None and "crashed once" in status.reason
        assert "garbage sent" in status.log_tail
        assert status.pid is None
    finally:
        pool.stop()


def test_a_worker_that_dies_at_start_is_retried_then_failed(tmp_path: Path, smollm2_path: Path) -> None:
    config = Config(models=(ModelConfig(id="d", path=str(smollm2_path)),))
    script = (
        "import subprocess, sys; child = subprocess.Popen(['sleep', '600']);"
        "print('child', child.pid, file=sys.stderr);"
        "print('boom: no module named llama_cpp', file=sys.stderr);"
        "sys.exit(3)"
    )  # exits at once, leaving a child behind in its process group
    pool = Pool(
        config,
        arena_dir=tmp_path / "arena",
        worker_argv=[sys.executable, "-c", script],
        max_restarts=2,
        restart_backoff_s=0.01,
    )
    events = Events()
    pool.subscribe(events)
    pool.start()
    try:
        failed = events.wait_for(lambda e: e.kind is EventKind.FAILED)
        crashes = [e for e in events.items if e.kind is EventKind.CRASHED]
        assert len(crashes) == 3 and all(e.extra["exit_code"] == 3 for e in crashes)
        status = failed.snapshot.model("d")
        assert status is not None and status.restarts == 2 and "crashed 3 times" in status.reason
        assert "boom: no module named llama_cpp" in status.log_tail
        children = [int(line.split()[1]) for line in status.log_tail if line.startswith("child ")]
        assert len(children) == 3
        assert _all_gone(children), {pid: proc_state(pid) for pid in children}  # its group was killed
        pool.wait_ready(timeout=1.0)  # FAILED counts as settled
    finally:
        pool.stop()
