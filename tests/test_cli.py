"""The CLI end to end: `timeshare status|models|pin|unpin|sleep|wake|chat` as subprocesses against a
real `timeshare serve` with the two demo models, found through the address file it wrote."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _api_util import GEMMA, SMOL, Served, run_cli, serve_env, serving_demo_models, woken
from _proc_util import wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- nothing running ---------------------------------------------------------------------------


def test_nothing_running_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # (`ls` and `show` list the configured models instead: test_cli_habits)
    for argv in (["status"], ["unload", SMOL], ["pin", SMOL], ["chat", SMOL, "hi"]):
        done = run_cli(home, *argv)
        assert done.returncode == 1, argv
        address = home / "run" / "api.json"
        assert done.stderr.strip() == (
            f"timeshare {argv[0]}: Timeshare is not running (no address in {address}); "
            "start it with `timeshare` or `timeshare serve`."
        )
        assert done.stdout == ""


def test_a_stale_address_file_says_not_running(tmp_path: Path) -> None:
    home = tmp_path / "home"
    address = home / "run" / "api.json"
    address.parent.mkdir(parents=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    address.write_text(json.dumps({"url": f"http://127.0.0.1:{_free_port()}", "pid": int(dead.stdout)}))
    done = run_cli(home, "status")
    assert done.returncode == 1
    assert "Timeshare is not running" in done.stderr and "has exited" in done.stderr
    # a live pid but nothing listening: the connection attempt decides
    address.write_text(json.dumps({"url": f"http://127.0.0.1:{_free_port()}", "pid": os.getpid()}))
    done = run_cli(home, "status")
    assert done.returncode == 1
    assert "Timeshare is not running" in done.stderr and "does not answer" in done.stderr


def test_url_override_that_does_not_answer(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    done = run_cli(tmp_path / "home", "status", "--url", url)
    assert done.returncode == 1
    assert f"Cannot reach Timeshare at {url}" in done.stderr and "--url" in done.stderr


def test_doctor_env_lists_every_variable_with_its_value(tmp_path: Path) -> None:
    from timeshare.core import envvars

    home = tmp_path / "home"
    done = run_cli(home, "doctor", "--env", "--json", env_extra={"TIMESHARE_OVERLAP_RESTORE": "0"})
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {var.name for var in envvars.REGISTRY}
    assert rows["TIMESHARE_HOME"]["value"] == str(home) and rows["TIMESHARE_HOME"]["kind"] == "product"
    assert rows["TIMESHARE_OVERLAP_RESTORE"]["value"] == "0"
    assert rows["TIMESHARE_OVERLAP_RESTORE"]["kind"] == "escape hatch"
    assert all(row["help"] for row in rows.values())
    text = run_cli(home, "doctor", "--env", env_extra={"TIMESHARE_OVERLAP_RESTORE": "0"})
    assert text.returncode == 0 and "TIMESHARE_OVERLAP_RESTORE = 0" in text.stdout
    assert "escape hatch:" in text.stdout and "test:" in text.stdout


def test_every_option_and_argument_has_help() -> None:
    import argparse

    from timeshare.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "timeshare")
    assert missing == []


def test_global_options_work_after_the_verb(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    for argv in (["--config", str(missing), "serve"], ["serve", "--config", str(missing)]):
        done = run_cli(tmp_path / "home", *argv, "--port", "0")
        assert done.returncode == 2, done.stderr
        assert str(missing) in done.stderr and "unrecognized arguments" not in done.stderr
    # a value given before the verb is not overwritten by the verb's default
    from timeshare.cli import build_parser

    args = build_parser().parse_args(["--config", "a.toml", "-v", "chat", "m", "p"])
    assert args.config == "a.toml" and args.verbose is True
    args = build_parser().parse_args(["chat", "m", "p", "-v", "--config", "b.toml"])
    assert args.config == "b.toml" and args.verbose is True


# ---- against a running instance ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("cli-home")
    address = home / "run" / "api.json"
    # no config file: `timeshare serve` serves the demo models
    with serving_demo_models(home, smollm2_path, gemma3_path, config_file=False) as server:
        assert stat.S_IMODE(address.stat().st_mode) == 0o600
        record = json.loads(address.read_text())
        assert record["key_required"] is False and record["url"] == server.url
        assert server.url.startswith("http://127.0.0.1:")
        yield server
    # SIGTERM: every worker stopped, exit 0 (serving_demo_models checks it), the address file removed
    assert not address.exists()


def test_models(served: Served) -> None:
    done = run_cli(served.home, "models")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["ID", "NAME"]
    assert {line.split()[0] for line in lines[1:]} == {SMOL, GEMMA}
    gemma_line = next(line for line in lines if line.startswith(GEMMA))
    assert "fallback" in gemma_line and "Gemma Terms of Use" in gemma_line
    done = run_cli(served.home, "models", "--json")
    assert done.returncode == 0
    assert {m["id"] for m in json.loads(done.stdout)["data"]} == {SMOL, GEMMA}


def test_status(served: Served) -> None:
    done = run_cli(served.home, "status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert {m["id"] for m in status["models"]} == {SMOL, GEMMA}
    assert all(m["state"] in ("resident", "released", "sleeping") for m in status["models"])
    done = run_cli(served.home, "status")
    assert done.returncode == 0
    assert done.stdout.startswith("GPU holder: ")
    lines = done.stdout.splitlines()[1:]
    # which dialects are served where, then the table
    serving = [line for line in lines if line.startswith("Serving ")]
    assert serving and all(served.url in line for line in serving), done.stdout
    table = lines[len(serving) :]
    assert table[0].split()[:3] == ["MODEL", "STATE", "BUSY"]
    assert {row.split()[0] for row in table[1:]} == {SMOL, GEMMA}


def test_pin_unpin_sleep_wake(served: Served) -> None:
    done = run_cli(served.home, "pin", SMOL)
    assert done.returncode == 0 and done.stdout.startswith(f"{SMOL}: pinned"), done.stderr
    assert served.model_status(SMOL)["pinned"] is True
    done = run_cli(served.home, "unpin", SMOL)
    assert done.returncode == 0 and done.stdout.startswith(f"{SMOL}: unpinned")
    assert served.model_status(SMOL)["pinned"] is False
    # the verbs report the state after the command (--wait: however long a busy machine needs)
    done = run_cli(served.home, "sleep", GEMMA, "--wait", "120")
    assert done.returncode == 0 and done.stdout == f"{GEMMA}: put to sleep (now asleep)\n", done.stderr
    assert _state(served.status(), GEMMA) == "sleeping"
    done = run_cli(served.home, "wake", GEMMA, "--wait", "120")
    assert done.returncode == 0 and done.stdout in woken(GEMMA), done.stderr
    assert served.status()["holder"] == GEMMA
    # sleep --level as the API has it: weights keeps the KV cache on the device (state released)
    done = run_cli(served.home, "sleep", GEMMA, "--level", "weights", "--wait", "120")
    assert done.returncode == 0 and done.stdout == f"{GEMMA}: put to sleep (now set aside)\n", done.stderr
    done = run_cli(served.home, "sleep", GEMMA, "--level", "nope")
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr


def test_aliases(served: Served) -> None:
    for alias, command in (("ps", "status"), ("ls", "models")):
        short = run_cli(served.home, alias, "--json")
        long = run_cli(served.home, command, "--json")
        assert short.returncode == 0 and long.returncode == 0, short.stderr
        assert json.loads(short.stdout).keys() == json.loads(long.stdout).keys()
    assert run_cli(served.home, "ps").stdout.startswith("GPU holder: ")
    assert run_cli(served.home, "ls").stdout.split()[:2] == ["ID", "NAME"]


def test_serve_says_when_its_models_are_ready(served: Served) -> None:
    wait_until(lambda: "ready: 2 models at " in served.log_text(), 120, "the ready line")
    log = served.log_text()
    assert f"ready: 2 models at {served.url}\n" in log
    for model in (SMOL, GEMMA):
        assert f"model {model} ready (" in log
    assert httpx.get(f"{served.url}/health", timeout=30).json() == {"status": "ok"}


def test_a_closed_pipe_exits_quietly(served: Served) -> None:
    # `timeshare status | head -1` with head gone before the CLI writes: no traceback
    for argv in (["status"], ["models", "--json"]):
        with subprocess.Popen(
            [sys.executable, "-m", "timeshare", *argv],
            env=serve_env(served.home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()  # the reader is gone before the CLI has written anything
            err = proc.stderr.read()
            rc = proc.wait(120)
        # Python ignores SIGPIPE, so the first write fails with EPIPE and the CLI exits as a
        # shell tool killed by SIGPIPE would (128 + 13); 0 would mean the output was lost unseen
        assert rc == 141, err
        assert err == b"", err.decode(errors="replace")


def _state(status: dict[str, object], model: str) -> str:
    return next(m["state"] for m in status["models"] if m["id"] == model)  # type: ignore[attr-defined]


def test_unknown_model(served: Served) -> None:
    for argv in (["pin", "nope"], ["chat", "nope", "hi"]):
        done = run_cli(served.home, *argv)
        assert done.returncode == 1, argv
        # resolved by the CLI (ids, display names, unique prefixes): the sentence lists the ids
        assert "no model is called 'nope'; the models are:" in done.stderr and SMOL in done.stderr


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_chat(served: Served, model: str) -> None:
    # global options work after the verb too
    done = run_cli(served.home, "chat", model, "What is the capital of France?", "--max-tokens", "24", "-v")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), f"{model} answered nothing"
    assert done.stdout.endswith("\n")
    assert f"[{model}: " in done.stderr and "completion tokens" in done.stderr


def test_chat_reads_the_prompt_from_stdin(served: Served) -> None:
    for argv in (["chat", SMOL], ["chat", SMOL, "-"]):
        done = subprocess.run(
            [sys.executable, "-m", "timeshare", *argv, "--max-tokens", "16", "--temperature", "0"],
            env=serve_env(served.home),
            input="What is the capital of France?\n",
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), "no answer"
    done = subprocess.run(
        [sys.executable, "-m", "timeshare", "chat", SMOL],
        env=serve_env(served.home),
        input="  \n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "the prompt is empty" in done.stderr


def test_chat_says_why_it_waits(served: Served) -> None:
    # smollm2 takes the GPU and keeps it (pinned): a chat to gemma waits, and -v says why on stderr
    assert run_cli(served.home, "pin", SMOL).returncode == 0
    proc: subprocess.Popen[bytes] | None = None
    try:
        done = run_cli(served.home, "wake", SMOL, "--wait", "120")
        assert done.stdout in woken(SMOL), done.stdout + done.stderr
        proc = subprocess.Popen(
            [sys.executable, "-m", "timeshare", "chat", GEMMA, "Say hi.", "--max-tokens", "8", "-v"],
            env=serve_env(served.home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # until the line that names the reason; EOF fails below
            seen.append(line.decode(errors="replace"))
            if f"waiting for the GPU: pinned by {SMOL}" in seen[-1]:
                break
        assert seen and f"[{GEMMA}: waiting for the GPU: pinned by {SMOL}, " in seen[-1], seen
        assert seen[-1].rstrip().endswith(" s]"), seen
        assert proc.poll() is None, "the chat ended while the GPU was pinned"
    finally:
        run_cli(served.home, "unpin", SMOL)
    assert proc is not None
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode(errors="replace")
    assert out.strip(), "no answer once the GPU was free"
    assert f"[{GEMMA}: " in err.decode() and "completion tokens" in err.decode()


def test_chat_bad_max_tokens(served: Served) -> None:
    done = run_cli(served.home, "chat", SMOL, "hi", "--max-tokens", "0")
    assert done.returncode == 2 and "--max-tokens must be at least 1" in done.stderr


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C (SIGINT) does what it does in a terminal. A test run
    started in the background by a non-interactive shell (``pytest &``) ignores SIGINT, children
    inherit that, and Python keeps an ignored SIGINT ignored: the Ctrl-C tests would then see
    their SIGINT vanish."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_chat_streams_and_ctrl_c_cancels(served: Served) -> None:
    before = served.status()["switch_stats"]["cancelled_by_disconnect"]  # type: ignore[index]
    with subprocess.Popen(
        [sys.executable, "-m", "timeshare", "chat", GEMMA, "Count: 1, 2, 3, 4,", "--max-tokens", "1500"],
        env=serve_env(served.home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
    ) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.read1(64)  # type: ignore[attr-defined]
            assert first, "no output before the process ended"
            assert proc.poll() is None, "the answer came only at the end, not streamed"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    served.wait_until(
        lambda s: s["switch_stats"]["cancelled_by_disconnect"] > before,  # type: ignore[index]
        "the server to cancel the abandoned generation",
        60,
    )
    served.wait_until(lambda s: not _busy(s, GEMMA), "gemma to become idle", 60)


def _busy(status: dict[str, object], model: str) -> bool:
    return bool(next(m["busy"] for m in status["models"] if m["id"] == model))  # type: ignore[attr-defined]


class _Terminal:
    """A pseudo-terminal for an interactive command: ``expect`` reads until a marker appears."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            close_fds=True,
            preexec_fn=_default_sigint,
        )
        os.close(slave)
        self.seen = b""
        self.pos = 0

    def expect(self, marker: bytes, timeout: float = 300) -> str:
        """The output from the last marker up to and including the next ``marker``."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen[self.pos :]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} within {timeout} s; output: {self.seen[self.pos :]!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # EIO: the other side closed
                    chunk = b""
                assert chunk, f"the command ended before {marker!r}; output: {self.seen[self.pos :]!r}"
                self.seen += chunk
        end = self.seen.index(marker, self.pos) + len(marker)
        text, self.pos = self.seen[self.pos : end], end
        return text.decode(errors="replace")

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        os.close(self.master)


def _cost(text: str) -> tuple[int, int]:
    """(prompt tokens, evaluated) from the -v line '[model: 30 prompt (12 evaluated) + ...]'."""
    match = re.search(r"\[[^\]]*: (\d+) prompt \((\d+) evaluated\) \+ ", text)
    assert match, text
    return int(match[1]), int(match[2])


def test_run_is_one_conversation_and_ctrl_c_stops_an_answer(served: Served) -> None:
    argv = [sys.executable, "-m", "timeshare", "run", SMOL, "--temperature", "0", "--max-tokens", "64"]
    term = _Terminal([*argv, "-v"], serve_env(served.home))
    try:
        assert "Ctrl-D" in term.expect(b">>> ", 120)
        term.send(b"What is the capital of France? Answer in one word.\n")
        first = term.expect(b">>> ")
        prompt1, _ = _cost(first)
        # the second turn continues the conversation: only its new tokens are evaluated
        term.send(b"And of Germany?\n")
        second = term.expect(b">>> ")
        prompt2, evaluated2 = _cost(second)
        assert prompt2 > prompt1 and evaluated2 < prompt2 - prompt1 + 8, (first, second)

        # gemma holds the GPU, pinned: the next answer waits (the terminal shows why) until Ctrl-C
        before = served.status()["switch_stats"]["cancelled_by_disconnect"]  # type: ignore[index]
        assert run_cli(served.home, "pin", GEMMA).returncode == 0
        try:
            done = run_cli(served.home, "wake", GEMMA, "--wait", "120")
            assert done.stdout in woken(GEMMA), done.stdout + done.stderr
            term.send(b"And of Italy?\n")
            term.expect(f"waiting for the GPU: pinned by {GEMMA}".encode())
            term.proc.send_signal(signal.SIGINT)
            stopped = term.expect(b">>> ")
            assert "[stopped]" in stopped and "Traceback" not in stopped, stopped
            served.wait_until(
                lambda s: s["switch_stats"]["cancelled_by_disconnect"] > before,  # type: ignore[index]
                "the server to cancel the stopped request",
                60,
            )
        finally:
            run_cli(served.home, "unpin", GEMMA)
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C at the prompt: a fresh prompt
        term.expect(b">>> ")
        assert term.proc.poll() is None, "Ctrl-C ended the REPL"
        term.send(b"\x04")  # Ctrl-D at the prompt
        assert term.proc.wait(60) == 0
    finally:
        term.close()
    served.wait_until(lambda s: not _busy(s, SMOL), "smollm2 to become idle", 60)
