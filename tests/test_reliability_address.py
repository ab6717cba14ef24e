"""The CLI trusts only its own address file (issue 26): an `api.json` that another user could have
written (another owner, a group- or world-writable file or runtime dir, a symbolic link) is
refused with a sentence, and the API key is never sent to the address it names. A fake API on
127.0.0.1 records the requests it gets."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from timeshare.core import paths

from timeshare import cli

KEY = "s3cret-key-for-the-test"


class _Recorder(ThreadingHTTPServer):
    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def do_GET(self) -> None:
                recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
                body = json.dumps({"models": [], "devices": [], "gpu_holder": None}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Recorder, Path]]:
    """A listening fake API, an api.json naming it (key required), the key in the environment."""
    server = _Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    address = paths.api_address_file()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    address.write_text(json.dumps({"url": url, "pid": os.getpid(), "key_required": True}))
    address.chmod(0o600)
    address.parent.chmod(0o700)
    monkeypatch.setenv("TIMESHARE_API_KEY", KEY)
    yield server, address
    server.shutdown()
    server.server_close()
    thread.join()


def _status(capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(["status", "--json"])
    return rc, capsys.readouterr().err


def test_the_users_own_address_file_is_used_with_the_key(
    planted: tuple[_Recorder, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    server, _ = planted
    rc, err = _status(capsys)
    assert rc == 0, err
    assert [h.get("authorization") for h in server.seen] == [f"Bearer {KEY}"]


@pytest.mark.parametrize(
    ("what", "mode", "words"),
    [
        ("file", 0o620, "writable by others"),
        ("file", 0o602, "writable by others"),
        ("folder", 0o770, "writable by others"),
        ("folder", 0o1777, "writable by others"),  # a /tmp-like runtime dir
    ],
)
def test_an_address_file_others_could_write_is_refused_and_gets_no_key(
    planted: tuple[_Recorder, Path], capsys: pytest.CaptureFixture[str], what: str, mode: int, words: str
) -> None:
    server, address = planted
    (address if what == "file" else address.parent).chmod(mode)
    rc, err = _status(capsys)
    assert rc == 1
    assert words in err and str(address if what == "file" else address.parent) in err and "--url" in err
    assert server.seen == []  # not even a request without the key


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("what", ["file", "folder"])
def test_an_address_file_of_another_user_is_refused_and_gets_no_key(
    planted: tuple[_Recorder, Path], capsys: pytest.CaptureFixture[str], what: str
) -> None:
    server, address = planted
    os.chown(address if what == "file" else address.parent, 65534, 65534)
    rc, err = _status(capsys)
    assert rc == 1 and "belongs to uid 65534" in err, err
    assert server.seen == []


def test_a_symbolic_link_as_the_address_file_is_refused(
    planted: tuple[_Recorder, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    server, address = planted
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(address.read_text())
    address.unlink()
    address.symlink_to(elsewhere)
    rc, err = _status(capsys)
    assert rc == 1 and "symbolic link" in err, err
    assert server.seen == []


def test_an_explicit_url_is_the_users_choice(
    planted: tuple[_Recorder, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    server, address = planted
    address.chmod(0o666)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    assert cli.main(["status", "--json", "--url", url]) == 0
    assert [h.get("authorization") for h in server.seen] == [f"Bearer {KEY}"]
