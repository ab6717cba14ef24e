"""What the pool tells a worker at start: its model, arena settings and directories (``--spec`` JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

from ..config.schema import ArenaConfig, ModelConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")


@dataclass(frozen=True)
class WorkerSpec:
    model: ModelConfig
    arena: ArenaConfig
    arena_dir: str | None
    kv_dir: str
    event_log: str | None = None

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        """Parse the --spec argument. Raises ValueError with a sentence naming the bad field."""
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--spec is not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError("--spec must be a JSON object")
        for key in ("model", "kv_dir"):
            if key not in obj:
                raise ValueError(f"--spec lacks {key!r}")
        model = _dataclass_from(ModelConfig, obj["model"], "model")
        arena = _dataclass_from(ArenaConfig, obj.get("arena") or {}, "arena")
        return cls(
            model=model,
            arena=arena,
            arena_dir=obj.get("arena_dir"),
            kv_dir=str(obj["kv_dir"]),
            event_log=obj.get("event_log"),
        )

    def to_json(self) -> str:
        from dataclasses import asdict

        return json.dumps(
            {
                "model": asdict(self.model),
                "arena": asdict(self.arena),
                "arena_dir": self.arena_dir,
                "kv_dir": self.kv_dir,
                "event_log": self.event_log,
            },
            separators=(",", ":"),
        )


def _dataclass_from(cls: type[_D], obj: object, where: str) -> _D:
    if not isinstance(obj, dict):
        raise ValueError(f"--spec {where} must be an object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"--spec {where} has unknown field(s): {', '.join(unknown)}")
    try:
        return cls(**obj)
    except TypeError as exc:
        raise ValueError(f"--spec {where}: {exc}") from None
