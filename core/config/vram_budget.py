"""The VRAM budget a worker gets: ``arena.vram_budget``, or ``$TIMESHARE_VRAM_BUDGET`` in its place.

This is the one reader of ``$TIMESHARE_VRAM_BUDGET``. The pool resolves it when it spawns a worker
and passes the result in the worker's spec (``WorkerSpec.arena.vram_budget``): the worker never
reads the variable itself. The variable replaces the setting only when the config leaves it at its
default, "auto" (tests run with ``one-model``; one-off runs on a shared GPU).
"""

from __future__ import annotations

from dataclasses import replace

from .. import envvars
from ..arena.budget import AUTO, parse_budget
from ..errors import ConfigError
from .schema import ArenaConfig

BUDGET_ENV = envvars.VRAM_BUDGET.name


def effective_vram_budget(configured: str) -> str:
    """``configured`` (``arena.vram_budget``), or ``$TIMESHARE_VRAM_BUDGET`` when the config leaves
    it at "auto" and the variable is set. Raises ConfigError naming the bad value."""
    try:
        setting = parse_budget(configured)
    except ValueError as exc:
        raise ConfigError([f"arena.vram_budget: {exc}"]) from None
    env = envvars.VRAM_BUDGET.text()
    if not env or setting != AUTO:
        return configured
    try:
        parse_budget(env)
    except ValueError as exc:
        raise ConfigError([f"${BUDGET_ENV}: {exc}"]) from None
    return env


def resolve_arena(arena: ArenaConfig) -> ArenaConfig:
    """``arena`` with :func:`effective_vram_budget` in ``vram_budget``: what a worker's spec carries."""
    budget = effective_vram_budget(arena.vram_budget)
    return arena if budget == arena.vram_budget else replace(arena, vram_budget=budget)
