"""api.ollama_listen: a second listener on Ollama's address (no models needed: an empty pool)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from timeshare.core.api.server import ApiServer
from timeshare.core.config.files import load_config
from timeshare.core.config.schema import ApiConfig, Config
from timeshare.core.errors import ConfigError
from timeshare.core.pool.supervisor import Pool


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool(Config())
    p.start()
    yield p
    p.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_ollama_listener_serves_every_dialect(pool: Pool, tmp_path: Path) -> None:
    port = _free_port()
    api = ApiServer(
        pool, ApiConfig(port=0, ollama_listen=f"127.0.0.1:{port}"), address_file=tmp_path / "a.json"
    )
    api.start()
    try:
        assert api.ollama_url == f"http://127.0.0.1:{port}" and not api.ollama_refused
        assert httpx.get(f"{api.ollama_url}/", timeout=30).text == "Ollama is running"
        assert httpx.get(f"{api.ollama_url}/api/tags", timeout=30).json() == {"models": []}
        served = httpx.get(f"{api.url}/timeshare/v1/status", timeout=30).json()["served"]
        assert served["ollama"]["urls"] == [api.url, api.ollama_url]
        assert served["anthropic"]["urls"] == [api.url]
    finally:
        api.stop()


def test_a_taken_ollama_port_is_refused_with_a_sentence(pool: Pool, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = int(taken.getsockname()[1])
        api = ApiServer(
            pool, ApiConfig(port=0, ollama_listen=f"127.0.0.1:{port}"), address_file=tmp_path / "a.json"
        )
        api.start()
        try:
            assert api.ollama_url is None
            assert f"127.0.0.1:{port} is taken" in api.ollama_refused and "Settings" in api.ollama_refused
            # the API itself serves on, the Ollama routes included
            assert httpx.get(f"{api.url}/", timeout=30).text == "Ollama is running"
            served = httpx.get(f"{api.url}/timeshare/v1/status", timeout=30).json()["served"]
            assert served["ollama"]["refused"] == api.ollama_refused
        finally:
            api.stop()


def test_ollama_listen_is_checked_in_the_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[api]\nollama_listen = "127.0.0.1:11434"\n')
    assert load_config(path, check_paths=False).api.ollama_listen == "127.0.0.1:11434"
    assert load_config(tmp_path / "none.toml", check_paths=False).api.ollama_listen == ""
    for bad, words in (("11434", "host:port"), ("0.0.0.0:11434", "api.key")):
        path.write_text(f'[api]\nollama_listen = "{bad}"\n')
        with pytest.raises(ConfigError, match=words):
            load_config(path, check_paths=False)
