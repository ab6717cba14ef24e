"""Big integers (issue 26): a 5,000-digit integer anywhere in a request body (a field Timeshare
reads, one it ignores, deep inside one) is a 400 that names the field, never a 500 from Python's
int-string limit; a config file holding one is a config error. The API runs in-process over an
empty pool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from timeshare.core.api.server import ApiServer
from timeshare.core.config.files import load_config
from timeshare.core.config.schema import ApiConfig, Config
from timeshare.core.errors import ConfigError
from timeshare.core.pool.supervisor import Pool

BIG = "9" * 5000
CHAT = '{"model": "nope", "messages": [{"role": "user", "content": "hi"}]'


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    pool = Pool(Config())
    pool.start()
    server = ApiServer(pool, ApiConfig(port=0), address_file=tmp_path_factory.mktemp("api") / "api.json")
    server.start()
    yield server
    server.stop()
    pool.stop()


def _post(api: ApiServer, path: str, raw: str) -> httpx.Response:
    return httpx.post(
        f"{api.url}{path}", content=raw.encode(), headers={"content-type": "application/json"}, timeout=60
    )


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/chat/completions", CHAT + f', "ignored": {BIG}}}', "ignored"),
        ("/v1/chat/completions", CHAT + f', "metadata": {{"a": [1, -{BIG}]}}}}', "metadata.a[1]"),
        ("/v1/chat/completions", CHAT + f', "max_tokens": {BIG}}}', "max_tokens"),
        ("/v1/chat/completions", CHAT + f', "seed": {BIG}}}', "seed"),
        ("/v1/completions", f'{{"model": "nope", "prompt": [1, 2, {BIG}]}}', "prompt[2]"),
        (
            "/v1/completions",
            f'{{"model": "nope", "prompt": "x", "logit_bias": {{"5": {BIG}}}}}',
            "logit_bias.5",
        ),
    ],
)
def test_a_huge_integer_anywhere_is_a_400_naming_its_field(
    api: ApiServer, path: str, raw: str, param: str
) -> None:
    json.loads(raw.replace(BIG, "9"))  # the test's own body is JSON, apart from the number's size
    r = _post(api, path, raw)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param, error
    assert len(r.content) < 2000  # the number is not echoed back


def test_digits_in_a_string_are_text(api: ApiServer) -> None:
    raw = f'{{"model": "nope", "messages": [{{"role": "user", "content": "{BIG}"}}]}}'
    r = _post(api, "/v1/chat/completions", raw)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # parsed fine


def test_a_config_holding_a_huge_integer_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[api]\nport = {BIG}\n")
    with pytest.raises(ConfigError, match="cannot be read") as caught:
        load_config(path, check_paths=False)
    assert str(path) in str(caught.value)
