"""A config nested thousands of levels deep (issue 26) is a config error naming the problem: one
line and exit 2 from `timeshare serve`, a 400 from the reload endpoint; never a RecursionError."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from timeshare.core.api.server import ApiServer
from timeshare.core.config.files import MAX_CONFIG_DEPTH, load_config
from timeshare.core.config.schema import ApiConfig, Config
from timeshare.core.errors import ConfigError
from timeshare.core.pool.supervisor import Pool

from timeshare import cli

DEEP = 5000
CASES = {
    "arrays": "x = " + "[" * DEEP + "]" * DEEP + "\n",
    "inline tables": "x = " + "{a = " * DEEP + "1" + "}" * DEEP + "\n",
    "dotted keys": "[" + ".".join(["a"] * DEEP) + "]\nb = 1\n",
    "in a model": '[[models]]\nid = "m"\npath = "/m.gguf"\nextra = ' + "[" * DEEP + "]" * DEEP + "\n",
    "just over the limit": "x = " + "[" * (MAX_CONFIG_DEPTH + 1) + "]" * (MAX_CONFIG_DEPTH + 1) + "\n",
}


@pytest.mark.parametrize("text", CASES.values(), ids=CASES.keys())
def test_deep_nesting_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"more than {MAX_CONFIG_DEPTH} levels deep") as caught:
        load_config(path, check_paths=False)
    assert str(path) in str(caught.value) and len(str(caught.value)) < 400


def test_nesting_within_the_limit_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[a.b.c]\nd = [[1, 2], [3]]\n")
    with pytest.raises(ConfigError) as caught:  # an unknown section: refused, but for what it is
        load_config(path, check_paths=False)
    assert "levels deep" not in str(caught.value)


def test_serve_with_a_deep_config_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(CASES["arrays"])
    rc = cli.main(["serve", "--port", "0", "--config", str(path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2
    assert len(err) == 1 and re.search("levels deep", err[0]) and str(path) in err[0], err


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ApiServer, Path]]:
    path = tmp_path / "config.toml"
    path.write_text("")
    pool = Pool(Config())
    pool.start()
    api = ApiServer(pool, ApiConfig(port=0), address_file=tmp_path / "api.json", config_path=path)
    api.start()
    yield api, path
    api.stop()
    pool.stop()


def test_reloading_a_deep_config_is_a_400_and_the_server_keeps_serving(
    served: tuple[ApiServer, Path],
) -> None:
    api, path = served
    for text in (CASES["arrays"], CASES["inline tables"], CASES["dotted keys"]):
        path.write_text(text)
        r = httpx.post(f"{api.url}/timeshare/v1/reload", timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_config" and "levels deep" in error["message"]
    path.write_text("")
    assert httpx.post(f"{api.url}/timeshare/v1/reload", timeout=30).status_code == 200
    assert httpx.get(f"{api.url}/v1/models", timeout=30).status_code == 200
