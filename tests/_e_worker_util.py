"""A test-side handle on a real worker subprocess: spawn it on a socketpair, read its messages on
a thread into a queue, wait for them with a hang guard (never a timed assertion)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from timeshare.core.config.schema import ArenaConfig, ModelConfig
from timeshare.core.config.vram_budget import resolve_arena
from timeshare.core.errors import FrameError
from timeshare.core.sampling import FIELDS, Sampling
from timeshare.core.wire import protocol as p

GUARD_S = 60.0  # a hang guard, not a timing assertion
EOF = object()


def generate_message(req: str, **fields: Any) -> p.Generate:
    """A Generate from flat fields: the sampling ones (max_tokens 256 unless given) go into its
    Sampling, the others (prompt, messages, conversation, cache_prompt) are its own."""
    sampling = {name: fields.pop(name) for name in list(fields) if name in FIELDS}
    if "sampling" in fields:
        return p.Generate(req=req, **fields)
    return p.Generate(req=req, sampling=Sampling(**{"max_tokens": 256, **sampling}), **fields)


class WorkerHandle:
    def __init__(
        self,
        model: ModelConfig,
        tmp: Path,
        *,
        arena_dir: Path | None = None,
        arena: ArenaConfig | None = None,
        kv_dir: Path | None = None,
        event_log: Path | None = None,
        spec_override: str | None = None,
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.kv_dir = kv_dir or tmp / "kv"
        spec = spec_override or json.dumps(
            {
                "model": asdict(model),
                "arena": asdict(resolve_arena(arena or ArenaConfig())),  # as the pool does
                "arena_dir": str(arena_dir) if arena_dir else None,
                "kv_dir": str(self.kv_dir),
                "event_log": str(event_log) if event_log else None,
            }
        )
        self.sock, child = socket.socketpair()
        self.conn = p.Connection(self.sock)
        self.log_path = tmp / f"{model.id}-{os.getpid()}-{id(self)}.log"
        self._log = self.log_path.open("wb")
        env = dict(os.environ, TIMESHARE_HOME=str(tmp / "home"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "timeshare.core.worker", "--spec", spec, "--ipc-fd", str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=env,
        )
        child.close()
        self.events: queue.Queue[object] = queue.Queue()
        self.seen: list[object] = []
        self._sent_at: dict[str, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except FrameError as exc:
                self.events.put(exc)
                if exc.recoverable:
                    continue
                self.events.put(EOF)
                return
            except OSError:
                self.events.put(EOF)
                return
            if msg is None:
                self.events.put(EOF)
                return
            self.events.put(msg)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def next(self, timeout: float = GUARD_S) -> object:
        try:
            item = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"worker {self.model.id} sent nothing for {timeout} s; log:\n{self.log_text()}"
            ) from None
        self.seen.append(item)
        return item

    def expect(self, kind: type | tuple[type, ...], timeout: float = GUARD_S, **match: Any) -> Any:
        """Skip messages until one of ``kind`` (with matching fields) arrives; fail on EOF."""
        while True:
            item = self.next(timeout)
            if item is EOF:
                raise AssertionError(f"worker {self.model.id} closed the connection; log:\n{self.log_text()}")
            if isinstance(item, kind) and all(getattr(item, k, None) == v for k, v in match.items()):
                return item

    def ready(self) -> p.Ready:
        ready: p.Ready = self.expect((p.Ready, p.Error))
        if isinstance(ready, p.Error):
            raise AssertionError(f"worker failed to load: {ready}; log:\n{self.log_text()}")
        return ready

    def send(self, msg: object) -> None:
        if isinstance(msg, p.Generate):
            self._sent_at[msg.req] = len(self.seen)
        self.conn.send(msg)

    def send_bytes(self, data: bytes, reqs: tuple[str, ...] = ()) -> None:
        """Raw bytes on the pipe (frames, or part of one); ``reqs``: the Generates they begin."""
        for req in reqs:
            self._sent_at[req] = len(self.seen)
        self.sock.sendall(data)

    def generate(self, req: str, timeout: float = GUARD_S, **fields: Any) -> tuple[str, p.Done | p.Error]:
        self.send(generate_message(req, **fields))
        return self.collect(req, timeout)

    def collect(self, req: str, timeout: float = GUARD_S) -> tuple[str, p.Done | p.Error]:
        """The streamed text and the final Done/Error of ``req`` (messages of other requests that
        arrive meanwhile stay in ``seen`` for their own collect)."""
        pieces = []
        pos = self._sent_at.get(req, 0)
        while True:
            if pos < len(self.seen):
                msg = self.seen[pos]
                pos += 1
            else:
                msg = self.next(timeout)
                pos = len(self.seen)
                if msg is EOF:
                    raise AssertionError(
                        f"worker {self.model.id} closed the connection; log:\n{self.log_text()}"
                    )
            if getattr(msg, "req", None) != req or not isinstance(msg, (p.Token, p.Done, p.Error)):
                continue
            if isinstance(msg, p.Token):
                pieces.append(msg.text)
            else:
                return "".join(pieces), msg

    def status(self, req: str = "status") -> p.WorkerStatus:
        self.send(p.StatusRequest(req))
        reply: p.StatusReply = self.expect(p.StatusReply, req=req)
        return reply.status

    def wait_eof(self, timeout: float = GUARD_S) -> None:
        while self.next(timeout) is not EOF:
            pass

    def wait_exit(self, timeout: float = GUARD_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {self.model.id} did not exit; log:\n{self.log_text()}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.conn.close()
        self._log.close()
