"""The ``timeshare`` field every dialect adds to its answers where it has room (OpenAI's
completions and chunks, Anthropic's message and message_delta, Ollama's final object): what the
request cost in GPU switching; and the plain-JSON form of the state's dataclasses."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from ..state import SwitchStats
from ..wire.protocol import Timings


def plain(value: Any) -> Any:
    """Dataclasses, enums, tuples as plain JSON values."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def switch_extras(
    switch: SwitchStats | None,
    prompt_tokens_evaluated: int | None = None,
    batch_size: int | None = None,
    timings: Timings | None = None,
) -> dict[str, Any]:
    """The ``timeshare`` field added to completion responses: what the request cost in GPU switching,
    the most requests its model decoded together while it ran (``batch_size``) and where its first
    token went in the worker (``timings``, see docs/API.md)."""
    extras: dict[str, Any] = plain(switch) if switch is not None else {"switched": False}
    if prompt_tokens_evaluated is not None:
        extras["prompt_tokens_evaluated"] = prompt_tokens_evaluated
    if batch_size is not None:
        extras["batch_size"] = batch_size
    if timings is not None:
        extras["timings"] = {f: getattr(timings, f) for f in timings.__struct_fields__}
    return extras
