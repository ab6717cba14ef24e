"""Configuration: TOML loading, validation with field-path errors, atomic writes, defaults, the example."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from timeshare.core import paths
from timeshare.core.config import demo
from timeshare.core.config import files as config_files
from timeshare.core.config import schema as config_schema
from timeshare.core.config import validate as config_validate
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, GeneralConfig, ModelConfig
from timeshare.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "resources" / "config.example.toml"


@pytest.fixture
def model_file(tmp_path: Path, smollm2_path: Path) -> Path:
    # a real GGUF under a name of our own (a link: no copy of the weights)
    target = tmp_path / "models" / "smol.gguf"
    target.parent.mkdir()
    target.symlink_to(smollm2_path)
    return target


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return excinfo.value.problems


# ---- loading -------------------------------------------------------------------------------


def test_full_config_loads(tmp_path: Path, model_file: Path) -> None:
    path = write(
        tmp_path / "config.toml",
        f"""
[general]
start_at_login = true
[arena]
dir = "~/arena"
min_quantum_ms = 100
wait_timeout_s = 5
[api]
host = "0.0.0.0"
port = 9000
key = "sekrit"
queue_limit = 3
[[models]]
id = "smol"
path = "{model_file}"
n_ctx = 512
n_seq = 2
pinned = true
idle_sleep_s = false
idle_release = "weights+kv"
host_shadow = "pageable"
chat_format = "fallback"
""",
    )
    config = config_files.load_config(path)
    assert config.general == GeneralConfig(start_at_login=True)
    assert config.arena == ArenaConfig(
        dir=str(Path.home() / "arena"), min_quantum_ms=100.0, wait_timeout_s=5.0
    )
    assert config.api == ApiConfig(host="0.0.0.0", port=9000, key="sekrit", queue_limit=3)
    (model,) = config.models
    assert model == ModelConfig(
        id="smol",
        path=str(model_file),
        n_ctx=512,
        n_seq=2,
        pinned=True,
        idle_sleep_s=None,
        idle_release="weights+kv",
        host_shadow="pageable",
        chat_format="fallback",
    )
    assert config.notice == ""


def test_default_path_is_platformdirs_config_file(model_file: Path) -> None:
    write(paths.config_file(), f'[[models]]\nid = "a"\npath = "{model_file}"\n')
    assert [m.id for m in config_files.load_config().models] == ["a"]


def test_relative_model_path_is_relative_to_the_config_file(tmp_path: Path, model_file: Path) -> None:
    path = write(tmp_path / "config.toml", '[[models]]\nid = "a"\npath = "models/smol.gguf"\n')
    assert config_files.load_config(path).models[0].path == str(model_file)


def test_missing_file_gives_the_demo_models(tmp_path: Path) -> None:
    config = config_files.load_config(tmp_path / "absent.toml")
    installed = [d.id for d in demo.available()]
    assert installed, "the demo packages are part of the test environment"
    assert [m.id for m in config.models] == installed
    for m in config.models:
        assert Path(m.path).is_file()
        assert m.licence
    assert config.notice == ""
    assert not (tmp_path / "absent.toml").exists()  # loading never writes


def test_no_config_and_no_demo_models_gives_an_empty_pool_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the demo packages are installed here; simulate a machine without them
    monkeypatch.setattr(demo, "available", lambda: [])
    config = config_files.load_config(tmp_path / "absent.toml")
    assert config.models == ()
    assert "No models are configured" in config.notice
    assert "Settings" in config.notice


def test_config_without_models_says_how_to_add_one(tmp_path: Path) -> None:
    path = write(tmp_path / "config.toml", "[api]\nport = 8000\n")
    config = config_files.load_config(path)
    assert config.models == ()
    assert str(path) in config.notice


# ---- validation: field-path errors, nothing written ----------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "n_ctx = -1",
            "models[0].n_ctx: must be 0 (auto: fitted to the device) or a number of tokens, not -1",
        ),
        (
            "n_ctx = -5",
            "models[0].n_ctx: must be 0 (auto: fitted to the device) or a number of tokens, not -5",
        ),
        ('n_ctx = "big"', "models[0].n_ctx: must be an integer, not a string"),
        ("n_ctx = true", "models[0].n_ctx: must be an integer, not a boolean"),
        ("nctx = 512", "models[0].nctx: unknown key (did you mean n_ctx?)"),
        (
            "n_gpu_layers = -2",
            "models[0].n_gpu_layers: must be -1 (all layers, or as many as fit), 0 (CPU only) or a number "
            "of layers, not -2",
        ),
        ('kv_cache_type = "q3"', "models[0].kv_cache_type: must be one of 'f16', 'q8_0', 'q4_0', not 'q3'"),
        ("n_seq = 0", "models[0].n_seq: must be > 0"),
        (
            'idle_release = "nap"',
            "models[0].idle_release: must be one of 'weights', 'weights+kv', 'stop', not 'nap'",
        ),
        ('host_shadow = "gpu"', "models[0].host_shadow: must be one of 'pinned', 'pageable', not 'gpu'"),
        (
            "chat_format = 1",
            "models[0].chat_format: must be one of 'auto', 'template', 'fallback', not an integer",
        ),
        ("idle_sleep_s = -1", "models[0].idle_sleep_s: must be >= 0"),
        ("idle_sleep_s = true", "models[0].idle_sleep_s: must be a number of seconds, or false for never"),
        ('pinned = "yes"', "models[0].pinned: must be true or false, not a string"),
        ('chat_template = ""', "models[0].chat_template: must not be empty"),
    ],
)
def test_model_field_errors(tmp_path: Path, model_file: Path, body: str, expected: str) -> None:
    path = write(tmp_path / "config.toml", f'[[models]]\nid = "a"\npath = "{model_file}"\n{body}\n')
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(path)
    assert problems_of(excinfo) == [expected]
    assert excinfo.value.path == str(path)
    assert str(excinfo.value).startswith(f"{path}: {expected}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[api]\nport = 0\n", "api.port: must be > 0"),
        ("[api]\nport = 70000\n", "api.port: must be <= 65535"),
        ('[api]\nhost = "0.0.0.0"\n', "api.key: is required when api.host is '0.0.0.0'"),
        ('[api]\nhost = "192.168.1.5"\nkey = ""\n', "api.key: must not be empty"),
        ("[api]\nqueue_limit = 0\n", "api.queue_limit: must be > 0"),
        ("[api]\nprot = 1\n", "api.prot: unknown key (did you mean port?)"),
        ("[arena]\nwait_timeout_s = 0\n", "arena.wait_timeout_s: must be > 0"),
        ("[arena]\nmin_quantum_ms = -1.5\n", "arena.min_quantum_ms: must be >= 0"),
        ("[arena]\nrestore_oom_retry_s = -1\n", "arena.restore_oom_retry_s: must be >= 0"),
        ("[general]\nstart_at_login = 1\n", "general.start_at_login: must be true or false, not an integer"),
        ("[modles]\n", "modles: unknown key (did you mean models?)"),
        ("general = 3\n", "general: must be a table ([general]), not an integer"),
        ('models = "x"\n', "models: must be an array of tables ([[models]]), not a string"),
        ('[[models]]\npath = "/x.gguf"\n', "models[0].id: is required"),
        ('[[models]]\nid = "a"\n', "models[0].path: is required"),
        ('[[models]]\nid = "Big Model"\npath = "/x"\n', "models[0].id: 'Big Model' may contain only"),
    ],
)
def test_section_errors(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path / "config.toml", text)
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(path, check_paths=False)
    assert len(problems_of(excinfo)) == 1, problems_of(excinfo)
    assert problems_of(excinfo)[0].startswith(expected)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_key(tmp_path: Path, host: str) -> None:
    path = write(tmp_path / "config.toml", f'[api]\nhost = "{host}"\n')
    assert config_files.load_config(path).api.host == host


def test_missing_model_file(tmp_path: Path) -> None:
    path = write(tmp_path / "config.toml", '[[models]]\nid = "a"\npath = "/nowhere/x.gguf"\n')
    before = path.read_bytes()
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(path)
    assert problems_of(excinfo) == [
        "models[0].path: model file /nowhere/x.gguf (of model 'a') does not exist: "
        "check the path, which must name a .gguf file"
    ]
    assert path.read_bytes() == before


def test_model_path_that_is_a_folder(tmp_path: Path) -> None:
    path = write(tmp_path / "config.toml", f'[[models]]\nid = "a"\npath = "{tmp_path}"\n')
    with pytest.raises(ConfigError, match=r"models\[0\]\.path: .* is a folder, not a file"):
        config_files.load_config(path)


def test_model_file_that_is_not_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"<html>404 not found</html>")
    path = write(tmp_path / "config.toml", f'[[models]]\nid = "a"\npath = "{bogus}"\n')
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(path)
    (problem,) = problems_of(excinfo)
    assert problem.startswith(
        f"models[0].path: model file {bogus} (of model 'a') is not a GGUF file "
        "(it starts with '<htm', not 'GGUF'; it looks like a web page: the download went wrong)"
    )
    assert bogus.read_bytes() == b"<html>404 not found</html>"


def test_duplicate_ids_and_every_problem_reported_at_once(tmp_path: Path, model_file: Path) -> None:
    path = write(
        tmp_path / "config.toml",
        f"""
[api]
port = 0
[[models]]
id = "a"
path = "{model_file}"
[[models]]
id = "b"
path = "{model_file}"
n_ctx = -1
[[models]]
id = "a"
path = "{model_file}"
""",
    )
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(path)
    assert problems_of(excinfo) == [
        "api.port: must be > 0",
        "models[1].n_ctx: must be 0 (auto: fitted to the device) or a number of tokens, not -1",
        "models[2].id: 'a' is already used by models[0]",
    ]


def test_toml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "config.toml", "[api]\nport = 8000\nhost = \n")
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(path)
    (problem,) = problems_of(excinfo)
    assert "TOML syntax error" in problem
    assert "line 3, column 8" in problem
    assert excinfo.value.path == str(path)


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'[api]\nhost = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match=r"is not UTF-8 text .*offset 14.*save it as UTF-8"):
        config_files.load_config(path)


def test_config_path_that_is_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        config_files.load_config(tmp_path)


# ---- writing -------------------------------------------------------------------------------


def sample_config(model_path: Path) -> Config:
    return Config(
        models=(
            ModelConfig(id="smol", path=str(model_path), name="Smol", n_ctx=1024, idle_sleep_s=None),
            ModelConfig(id="other", path=str(model_path), chat_template="{{ messages }}", pinned=True),
        ),
        arena=ArenaConfig(min_quantum_ms=50.0),
        api=ApiConfig(port=9999, key="k"),
        general=GeneralConfig(start_at_login=True),
    )


def test_save_then_load_round_trips(tmp_path: Path, model_file: Path) -> None:
    config = sample_config(model_file)
    written = config_files.save_config(config, tmp_path / "config.toml")
    assert written == tmp_path / "config.toml"
    assert config_files.load_config(written) == config
    assert oct(written.stat().st_mode & 0o777) == oct(0o600)


def test_save_defaults_to_the_config_file(model_file: Path) -> None:
    config_files.save_config(sample_config(model_file))
    assert config_files.load_config() == sample_config(model_file)


def test_save_keeps_comments_and_makes_a_backup(tmp_path: Path, model_file: Path) -> None:
    path = write(
        tmp_path / "config.toml",
        f"""# my precious notes
[api]
port = 8385  # the usual port
[[models]]
# the small one
id = "smol"
path = "{model_file}"
n_ctx = 512
""",
    )
    original = path.read_text()
    config = config_files.load_config(path)
    changed = dataclasses.replace(
        config,
        api=dataclasses.replace(config.api, port=9000),
        models=(
            dataclasses.replace(config.models[0], n_ctx=1024),
            ModelConfig(id="new", path=str(model_file)),
        ),
    )
    config_files.save_config(changed, path)
    text = path.read_text()
    assert "# my precious notes" in text
    assert "# the small one" in text
    assert "port = 9000" in text
    assert config_files.load_config(path) == changed
    assert (tmp_path / "config.toml.bak").read_text() == original


def test_save_keeps_the_users_spelling_of_paths(tmp_path: Path, model_file: Path) -> None:
    path = write(
        tmp_path / "config.toml",
        '[arena]\ndir = "~/arena"\n[[models]]\nid = "smol"\npath = "models/smol.gguf"\n',
    )
    config = config_files.load_config(path)
    assert config.models[0].path == str(model_file) and config.arena.dir == str(Path.home() / "arena")
    config_files.save_config(
        dataclasses.replace(config, models=(dataclasses.replace(config.models[0], n_ctx=99),)), path
    )
    text = path.read_text()
    assert 'path = "models/smol.gguf"' in text and 'dir = "~/arena"' in text
    assert config_files.load_config(path).models[0].n_ctx == 99


def test_removing_a_model_removes_its_table(tmp_path: Path, model_file: Path) -> None:
    path = config_files.save_config(sample_config(model_file), tmp_path / "config.toml")
    config = config_files.load_config(path)
    config_files.save_config(dataclasses.replace(config, models=config.models[1:]), path)
    assert [m.id for m in config_files.load_config(path).models] == ["other"]


def test_invalid_config_is_not_written(tmp_path: Path, model_file: Path) -> None:
    path = config_files.save_config(sample_config(model_file), tmp_path / "config.toml")
    before = path.read_bytes()
    bad = dataclasses.replace(sample_config(model_file), api=ApiConfig(host="0.0.0.0"))
    with pytest.raises(ConfigError, match=r"api\.key: is required"):
        config_files.save_config(bad, path)
    assert path.read_bytes() == before
    dup = Config(models=(ModelConfig(id="x", path="/a"), ModelConfig(id="x", path="/b")))
    with pytest.raises(ConfigError, match=r"models\[1\]\.id: 'x' is already used"):
        config_files.save_config(dup, path)
    assert path.read_bytes() == before


def test_crash_during_write_keeps_the_old_file(
    tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = config_files.save_config(sample_config(model_file), tmp_path / "config.toml")
    before = path.read_bytes()
    real_replace = os.replace

    def crash_on_config(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # fault injection: the process "dies" at the rename that would publish the new file
        if Path(dst) == path:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_config)
    with pytest.raises(OSError, match="No space left"):
        config_files.save_config(dataclasses.replace(sample_config(model_file), models=()), path)
    assert path.read_bytes() == before
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".config.toml")]
    assert leftovers == []


def test_save_over_an_unparseable_file_writes_a_fresh_one_and_keeps_the_old_as_bak(
    tmp_path: Path, model_file: Path
) -> None:
    path = write(tmp_path / "config.toml", "this is [not toml\n")
    config_files.save_config(sample_config(model_file), path)
    assert config_files.load_config(path) == sample_config(model_file)
    assert (tmp_path / "config.toml.bak").read_text() == "this is [not toml\n"


def test_config_to_toml_is_valid_and_complete(model_file: Path) -> None:
    text = config_files.config_to_toml(sample_config(model_file))
    assert config_validate.validate(config_files.parse_toml(text)) == sample_config(model_file)
    assert "idle_sleep_s = false" in text  # "never" has a TOML spelling


def test_suggest_model_id() -> None:
    assert config_schema.suggest_model_id("SmolLM2 135M Instruct.Q4_1") == "smollm2-135m-instruct.q4_1"
    assert config_schema.suggest_model_id("smol", taken=["smol", "smol-2"]) == "smol-3"
    assert config_schema.suggest_model_id("***") == "model"


# ---- the example ---------------------------------------------------------------------------


def test_example_config_is_valid() -> None:
    config = config_files.load_config(EXAMPLE, check_paths=False)
    assert [m.id for m in config.models] == ["smollm2-135m-instruct", "gemma3-270m"]
    assert config.models[0].chat_template and "{% for m in messages %}" in config.models[0].chat_template


def test_example_config_covers_every_key() -> None:
    raw = config_files.parse_toml(EXAMPLE.read_text())
    for section, cls in (("general", GeneralConfig), ("arena", ArenaConfig), ("api", ApiConfig)):
        assert set(raw[section]) == {f.name for f in dataclasses.fields(cls)}, section
    # the first model shows every key but `demo`, which the second (a demo model) shows instead of path
    assert set(raw["models"][0]) == {f.name for f in dataclasses.fields(ModelConfig)} - {"demo"}
    assert set(raw["models"][1]) == {"id", "demo"}
    assert set(raw) == {"general", "arena", "api", "models"}


def test_example_config_with_real_model_files_passes_the_path_checks(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    text = EXAMPLE.read_text()
    text = text.replace("~/models/SmolLM2-135M-Instruct.Q4_1.gguf", str(smollm2_path))
    path = write(tmp_path / "config.toml", text)
    config = config_files.load_config(path)
    # the demo model is found where its package (or Timeshare's cache) keeps it
    assert [m.path for m in config.models] == [str(smollm2_path), str(demo.expected_path(demo.GEMMA3_ID))]
    assert [m.demo for m in config.models] == [demo.SMOLLM2_ID, demo.GEMMA3_ID]


def test_example_values_are_the_defaults() -> None:
    # the example documents the defaults: keep the two in step
    raw = config_files.parse_toml(EXAMPLE.read_text())
    config = config_validate.validate(raw, check_paths=False)
    assert config.general == GeneralConfig()
    assert dataclasses.replace(config.arena, dir=None) == ArenaConfig()
    assert dataclasses.replace(config.api, key=None) == ApiConfig()
    first = config.models[0]
    defaults = ModelConfig(id=first.id, path=first.path)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("id", "path", "name", "chat_template", "max_tokens", "licence"):  # None: no TOML
            assert getattr(first, f.name) == getattr(defaults, f.name), f.name


def test_a_config_path_named_by_the_user_must_exist(tmp_path: Path) -> None:
    # the default location may be missing (defaults apply); a --config typo must not be
    missing = tmp_path / "typo.toml"
    with pytest.raises(ConfigError) as err:
        config_files.load_config(missing, must_exist=True)
    assert err.value.path == str(missing) and "does not exist" in err.value.problems[0]
    assert isinstance(config_files.load_config(missing), Config)


# ---- demo models by reference; models that fail on their own --------------------------------


def test_demo_models_are_written_by_reference_and_survive_a_cleared_cache(tmp_path: Path) -> None:
    # what Settings or "Start at login" writes: the demo models as `demo = "<id>"`, never the
    # assembled Gemma's cache path (clearing the cache must not break the next start)
    config = config_files.default_config()
    assert {m.demo for m in config.models} == {demo.SMOLLM2_ID, demo.GEMMA3_ID}
    target = config_files.save_config(config, tmp_path / "config.toml")
    raw = config_files.parse_toml(target.read_text())
    assert [(m["id"], m.get("demo"), m.get("path")) for m in raw["models"]] == [
        (demo.SMOLLM2_ID, demo.SMOLLM2_ID, None),
        (demo.GEMMA3_ID, demo.GEMMA3_ID, None),
    ]
    assert str(paths.cache_dir()) not in target.read_text()
    loaded = config_files.load_config(target)  # the file checks pass without the cache
    assert [m.path for m in loaded.models] == [m.path for m in config.models]
    assert loaded.models == config.models


def test_a_demo_models_cache_path_is_migrated_to_a_reference(tmp_path: Path) -> None:
    gemma_cache = demo.expected_path(demo.GEMMA3_ID)  # as an older Timeshare wrote it
    target = write(
        tmp_path / "config.toml",
        f'# mine\n[[models]]\nid = "gemma"\npath = "{gemma_cache}"\nname = "G"\n',
    )
    config = config_files.load_config(target, check_paths=False)
    assert config.models[0].demo == demo.GEMMA3_ID and config.models[0].path == str(gemma_cache)
    assert target.read_text().count("path =") == 1  # loading never writes
    config_files.save_config(config, target)  # the next save writes the reference
    text = target.read_text()
    assert "# mine" in text and 'demo = "gemma3-270m"' in text and "path =" not in text


def test_a_path_given_with_demo_wins(tmp_path: Path, model_file: Path) -> None:
    # e.g. the user located another copy of the file: that file, not the demo's
    target = write(
        tmp_path / "config.toml", f'[[models]]\nid = "g"\ndemo = "gemma3-270m"\npath = "{model_file}"\n'
    )
    (model,) = config_files.load_config(target).models
    assert (model.path, model.demo) == (str(model_file), "")


def test_an_unknown_demo_and_a_model_with_neither_path_nor_demo_are_refused(tmp_path: Path) -> None:
    target = write(tmp_path / "config.toml", '[[models]]\nid = "a"\ndemo = "gpt-5"\n[[models]]\nid = "b"\n')
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(target)
    problems = problems_of(excinfo)
    assert problems[0].startswith("models[0].demo: must be one of 'smollm2-135m-instruct', 'gemma3-270m'")
    assert problems[1].startswith("models[1].path: is required")


def test_missing_model_files_are_left_to_the_pool_when_starting(tmp_path: Path) -> None:
    # `timeshare` and `timeshare serve` load without the file checks: a missing model is FAILED
    # (tests/test_reliability.py), the others serve; type errors still refuse, with field paths
    target = write(tmp_path / "config.toml", '[[models]]\nid = "a"\npath = "/nowhere/x.gguf"\n')
    assert config_files.load_for_cli(str(target), check_paths=False).models[0].path == "/nowhere/x.gguf"
    write(target, '[[models]]\nid = "a"\npath = "/nowhere/x.gguf"\nn_ctx = "big"\n')
    with pytest.raises(ConfigError, match=r"models\[0\]\.n_ctx: must be an integer"):
        config_files.load_for_cli(str(target), check_paths=False)


def test_allowed_hosts_and_origins_are_checked_with_field_paths(tmp_path: Path) -> None:
    target = write(
        tmp_path / "config.toml",
        '[api]\nallowed_hosts = ["timeshare.lan", "*", "http://x/"]\n'
        'allowed_origins = ["http://localhost:3000", "*", "localhost:3000", "https://a.b/path"]\n',
    )
    with pytest.raises(ConfigError) as excinfo:
        config_files.load_config(target)
    assert [p.split(":")[0] for p in problems_of(excinfo)] == [
        "api.allowed_hosts[2]",
        "api.allowed_origins[2]",
        "api.allowed_origins[3]",
    ]
    write(target, '[api]\nallowed_hosts = "timeshare.lan"\n')
    with pytest.raises(ConfigError, match=r"api\.allowed_hosts: must be an array of strings"):
        config_files.load_config(target)
    write(
        target,
        '[api]\nallowed_hosts = ["Timeshare.LAN", "[::1]"]\nallowed_origins = ["http://localhost:3000"]\n',
    )
    api = config_files.load_config(target).api
    assert api.allowed_hosts == ("Timeshare.LAN", "[::1]") and api.allowed_origins == (
        "http://localhost:3000",
    )
    saved = config_files.save_config(Config(api=api), tmp_path / "saved.toml")
    assert config_files.load_config(saved).api == api
