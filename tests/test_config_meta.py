"""Every config field is declared once (core/config/schema.py with its meta.FieldMeta): validation
takes its range from there, and app/ writes no default, range or label of its own."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from timeshare.core.config import validate as config_validate
from timeshare.core.config.meta import FieldMeta, describe, described
from timeshare.core.config.schema import ApiConfig, ArenaConfig, GeneralConfig, ModelConfig
from timeshare.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SECTIONS: dict[str, type] = {
    "general": GeneralConfig,
    "arena": ArenaConfig,
    "api": ApiConfig,
    "models": ModelConfig,
}


@pytest.mark.parametrize("cls", SECTIONS.values(), ids=SECTIONS.keys())
def test_every_field_carries_its_meta(cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    assert [d.name for d in described(cls)] == names  # none without a label
    labels = [d.meta.label for d in described(cls)]
    assert len(set(labels)) == len(labels), "two fields of one section share a label"
    for d in described(cls):
        meta = d.meta
        assert isinstance(meta, FieldMeta) and meta.label and not meta.label.endswith(":")
        if isinstance(d.default, (int, float)) and not isinstance(d.default, bool):
            # the default lies in its own range
            assert meta.minimum is None or d.default >= meta.minimum, d.name
            assert meta.maximum is None or d.default <= meta.maximum, d.name
        if meta.choices and d.default is not None:
            assert d.default in meta.choices, d.name
        if meta.ui_maximum is not None:
            assert meta.maximum is None, f"{d.name}: ui_maximum is for fields the file does not bound"


def _raw(section: str, name: str, value: object) -> dict[str, Any]:
    if section == "models":
        return {"models": [{"id": "m", "path": "/nowhere.gguf", name: value}]}
    return {section: {name: value}}


def _accepts(section: str, name: str, value: object) -> bool:
    try:
        config_validate.validate(_raw(section, name, value), check_paths=False)
    except ConfigError as e:
        assert any(name in p for p in e.problems), e.problems
        return False
    return True


INTEGERS = [
    (section, d.name)
    for section, cls in SECTIONS.items()
    for d in described(cls)
    if (d.meta.minimum is not None or d.meta.maximum is not None)
    and {f.name: f.type for f in dataclasses.fields(cls)}[d.name] in ("int", "int | None")
]
NUMBERS = [
    (section, d.name)
    for section, cls in SECTIONS.items()
    for d in described(cls)
    if d.meta.minimum is not None and (section, d.name) not in INTEGERS
]


def test_the_ranged_fields_are_found() -> None:
    # the parametrisations below must cover what they are for
    assert ("api", "port") in INTEGERS and ("models", "n_seq") in INTEGERS
    assert ("arena", "min_quantum_ms") in NUMBERS and ("models", "idle_sleep_s") in NUMBERS


@pytest.mark.parametrize(("section", "name"), INTEGERS)
def test_validation_takes_an_integer_range_from_the_meta(section: str, name: str) -> None:
    meta = describe(SECTIONS[section], name).meta
    if meta.minimum is not None:
        low = int(meta.minimum)
        assert _accepts(section, name, low) and not _accepts(section, name, low - 1)
    if meta.maximum is not None:
        high = int(meta.maximum)
        assert _accepts(section, name, high) and not _accepts(section, name, high + 1)


@pytest.mark.parametrize(("section", "name"), NUMBERS)
def test_validation_takes_a_lower_bound_from_the_meta(section: str, name: str) -> None:
    meta = describe(SECTIONS[section], name).meta
    assert meta.minimum is not None
    assert not _accepts(section, name, meta.minimum - 0.5)
    assert _accepts(section, name, meta.minimum + 0.5)
    assert _accepts(section, name, float(meta.minimum)) is not meta.strict_minimum


@pytest.mark.parametrize(
    ("section", "name"), [("models", "chat_format"), ("models", "idle_release"), ("models", "host_shadow")]
)
def test_validation_takes_the_choices_from_the_meta(section: str, name: str) -> None:
    for choice in describe(SECTIONS[section], name).meta.choices:
        assert _accepts(section, name, choice)
    assert not _accepts(section, name, "no-such-choice")


# ---- no default written in app/ --------------------------------------------------------------

SETTERS = {"setRange", "setMinimum", "setMaximum", "setValue", "setSuffix", "setSpecialValueText"}


def _field_defaults() -> dict[str, object]:
    return {
        d.name: d.default for cls in SECTIONS.values() for d in described(cls) if d.default not in (None, "")
    }


def _meta_words() -> set[str]:
    """Labels (long enough not to be everyday words), help and special texts of every field, as a
    GPU build and a CPU-only one word them ("{the GPU|its turn}": core/words.for_device)."""
    words: set[str] = set()
    for cls in SECTIONS.values():
        for d in described(cls):
            for meta in (d.meta.worded(gpu=True), d.meta.worded(gpu=False)):
                words.update(w for w in (meta.help, meta.special) if w)
                if len(meta.label) >= 12:
                    words.add(meta.label)
    return words


def written_twice(source: str) -> list[str]:
    """What an app/ settings module writes that config/schema.py already holds: a field's default
    as a ``.get(field, default)`` fallback, a literal range/suffix/value on a spin box, a label,
    help or special text as a literal."""
    defaults = _field_defaults()
    words = _meta_words()
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = node.args
            if (
                node.func.attr == "get"
                and len(args) == 2
                and isinstance(args[0], ast.Constant)
                and args[0].value in defaults
                and not (isinstance(args[1], ast.Constant) and args[1].value is None)
            ):
                found.append(f"line {node.lineno}: .get({args[0].value!r}, <a default>)")
            elif node.func.attr in SETTERS and any(
                isinstance(a, ast.Constant) and not isinstance(a.value, bool) for a in args
            ):
                found.append(f"line {node.lineno}: {node.func.attr} with a literal")
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.rstrip(":") in words
        ):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def settings_modules() -> list[Path]:
    app = ROOT / "app"
    return sorted({*app.glob("settings*.py"), *app.glob("settings/*.py")})


def test_app_writes_no_config_default() -> None:
    modules = settings_modules()
    assert modules, "no Settings module found under app/"
    bad = {str(p.relative_to(ROOT)): written_twice(p.read_text()) for p in modules}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_twice_check_catches_what_it_is_for() -> None:
    old = """
box.setRange(0, 60000)
box.setSuffix(" ms")
box.setValue(float(arena.get("min_quantum_ms", 250.0)))
port.setValue(int(api.get("port", 8385)))
form.addRow("A busy model keeps the GPU at least:", box)
"""
    assert len(written_twice(old)) == 5
    new = """
_spin(box, ArenaConfig, "min_quantum_ms", _initial(arena, ArenaConfig, "min_quantum_ms"))
key = QLineEdit(str(api.get("key") or ""))
form.addRow(_label(ArenaConfig, "min_quantum_ms"), box)
"""
    assert written_twice(new) == []
