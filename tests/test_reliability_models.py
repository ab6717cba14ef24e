"""`GET /v1/models` lists the configured models from its first answer (issue 26): `serve` opens
the port before the pool thread has made its records, and a client that lists the models at
connect got `{"data": []}`. Here the API serves a pool that has not started yet."""

from __future__ import annotations

from pathlib import Path

import httpx
from timeshare.core.api.server import ApiServer
from timeshare.core.config.schema import ApiConfig, Config, ModelConfig
from timeshare.core.pool.supervisor import Pool


def test_the_models_are_listed_as_starting_before_the_pool_has_run(tmp_path: Path) -> None:
    config = Config(
        models=(
            ModelConfig(id="alpha", path=str(tmp_path / "a.gguf")),
            ModelConfig(id="beta", path=str(tmp_path / "b.gguf"), pinned=True),
        )
    )
    pool = Pool(config)  # not started: what the API sees in its first moments under `serve`
    api = ApiServer(pool, ApiConfig(port=0), address_file=tmp_path / "api.json")
    api.start()
    try:
        listed = httpx.get(f"{api.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == ["alpha", "beta"]
        assert {m["timeshare"]["state"] for m in listed} == {"starting"}
        assert [m["timeshare"]["pinned"] for m in listed] == [False, True]
        one = httpx.get(f"{api.url}/v1/models/beta", timeout=30)
        assert one.status_code == 200 and one.json()["timeshare"]["state"] == "starting"
    finally:
        api.stop()
