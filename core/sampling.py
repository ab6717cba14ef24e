"""The one sampling contract: what a request asks of the sampler, carried unchanged from a front end
(the HTTP API's dialects, the chat service, the CLI) through the pool to the worker.

``Sampling`` is a frozen msgspec Struct, so it travels inside the pool<->worker frames as it is and
decodes with its constraints checked. A front end builds one with ``Sampling(**fields)`` from its own
defaults (``DEFAULTS`` below, one row per front end) and calls ``check`` before handing it on;
the worker trusts what ``check`` accepted.

Fields (llama.cpp's names and meanings; llama-server's defaults where the worker has one):

- ``max_tokens``: the answer's token limit; ``None`` = until an end-of-generation token, a stop
  string or the end of the context (a model's own cap, ``ModelConfig.max_tokens``, applies in the
  worker).
- ``temperature`` 0 = greedy (the chain is ``greedy`` alone); below 0 = sample from the raw
  distribution; above 0: ``top_k``, ``top_p``, ``min_p``, ``temp``, ``dist(seed)``.
- ``min_p`` defaults to 0.05, the value llama-cpp-python's create_completion applied to every
  sampled request: seeded answers stay what they were.
- ``seed`` ``None``: a random seed per request. Choice ``i`` of a request with ``n`` choices uses
  ``seed + i``.
- penalties (``presence_penalty``, ``frequency_penalty``, ``repeat_penalty`` over the last
  ``repeat_last_n`` tokens) are llama.cpp's ``penalties`` sampler; neutral values leave it out of
  the chain.
- ``logit_bias``: (token id, bias) pairs; ``-inf`` bans a token.
- ``grammar``: GBNF text (from ``response_format``, tools, or the ``grammar`` extension); with
  ``grammar_triggers`` it is lazy: it applies from the first match of one of those patterns on
  (``llama_sampler_init_grammar_lazy_patterns``); without, from the first token. Applied by
  rejection (sample, check, mask the vocabulary only when the grammar rejects the token).
- ``logprobs`` / ``top_logprobs``: report the sampled token's log-probability (log-softmax of the
  raw logits) and the ``top_logprobs`` most likely alternatives per token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

import msgspec

#: the most stop strings a request may carry (the API refuses more)
MAX_STOP = 16
#: the most alternatives per token ``top_logprobs`` may ask for (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
#: llama-cpp-python's min_p default (see the module docstring)
MIN_P = 0.05


class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: float = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 40  # 0: no limit
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = MIN_P
    seed: Annotated[int, msgspec.Meta(ge=0, lt=2**32)] | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    repeat_last_n: Annotated[int, msgspec.Meta(ge=-1)] = 64  # -1: the whole context
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    grammar_triggers: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties sampler has anything to do."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1.0)

    def for_choice(self, i: int) -> Sampling:
        """Choice ``i`` of an ``n``-choice request: the same, seeded ``seed + i``."""
        if i == 0 or self.seed is None:
            return self
        return msgspec.structs.replace(self, seed=self.seed + i)

    def replace(self, **changes: object) -> Sampling:
        return msgspec.structs.replace(self, **changes)


def check(s: Sampling) -> Sampling:
    """Validate a Sampling built in Python (msgspec checks constraints only when it decodes); raises
    ValueError naming the field. Returns ``s``."""
    try:
        msgspec.convert(msgspec.to_builtins(s), Sampling)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling: {exc}") from None
    if not math.isfinite(s.temperature) or not -1.0 <= s.temperature <= 2.0:
        raise ValueError(f"sampling: temperature must be from 0 to 2 (got {s.temperature!r})")
    if len(s.stop) > MAX_STOP:
        raise ValueError(f"sampling: at most {MAX_STOP} stop strings (got {len(s.stop)})")
    if any(not x for x in s.stop):
        raise ValueError("sampling: a stop string may not be empty")
    if s.grammar_triggers and not s.grammar:
        raise ValueError("sampling: grammar_triggers need a grammar")
    for token, bias in s.logit_bias:
        if token < 0 or math.isnan(bias):
            raise ValueError(f"sampling: logit_bias entry ({token}, {bias}) is not a token id and a bias")
    return s


#: OpenAI's documented default for /v1/completions
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: the CLI's temperature when --temperature is not given
CLI_TEMPERATURE = 0.2
#: the chat window's longest answer for a new conversation (a limit people can raise or turn off in
#: Answer settings; a base model's is shorter, see ``BASE_MODEL``)
CHAT_WINDOW_MAX_TOKENS = 1024
#: a repetition guard: llama.cpp's repeat penalty over the last 64 tokens (1.0: off)
REPETITION_GUARD = 1.3

#: Each front end's defaults, in one table: where a field is absent from a request, the front
#: end's row gives it (then Sampling's own default):
#: - "api_chat" / "api_completion": the HTTP API (``temperature`` 1 and ``top_p`` 1 as OpenAI's;
#:   chat without ``max_tokens`` runs until a stop or the end of the context, as OpenAI and
#:   llama-server; completions keep OpenAI's documented 16);
#: - "chat_window": the chat service; a conversation's own settings (``Store.set_options``:
#:   temperature, max_tokens, repeat_penalty) are given as fields, so this row applies only where
#:   they are not, and to a new conversation (``new_conversation``); a conversation's "no limit"
#:   (max_tokens None) is kept as none by the chat service;
#: - "cli_chat" / "cli_run": ``timeshare chat`` and ``timeshare run`` (the body they send to the
#:   API; no limit unless ``--max-tokens``);
#: - "chat_window_base": a new conversation with a base model (no chat template, e.g. the
#:   Gemma-3-270M demo), which continues text rather than answering and, greedy, repeats itself:
#:   a shorter answer and the repetition guard on (both shown, and changeable, in Answer settings);
#: - "internal": ``Pool.generate`` without a sampling (diagnostics, tests): greedy, 256 tokens.
#: A model's ``max_tokens`` setting caps every answer in the worker.
DEFAULTS: dict[str, dict[str, object]] = {
    "api_chat": {"max_tokens": None, "temperature": 1.0, "top_p": 1.0},
    "api_completion": {"max_tokens": DEFAULT_COMPLETION_MAX_TOKENS, "temperature": 1.0, "top_p": 1.0},
    "chat_window": {"max_tokens": CHAT_WINDOW_MAX_TOKENS, "temperature": 0.0, "repeat_penalty": 1.0},
    "chat_window_base": {"max_tokens": 200, "temperature": 0.0, "repeat_penalty": REPETITION_GUARD},
    "cli_chat": {"max_tokens": None, "temperature": CLI_TEMPERATURE},
    "cli_run": {"max_tokens": None, "temperature": CLI_TEMPERATURE},
    # the other dialects (core/api/anthropic.py, ollama.py): their own servers' defaults
    "api_anthropic": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
    # core/api/responses.py: OpenAI's Responses API (as chat: no length limit unless asked)
    "api_responses": {"max_tokens": None, "temperature": 1.0, "top_p": 1.0},
    "api_ollama": {"max_tokens": None, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "repeat_penalty": 1.1},
    "internal": {"max_tokens": 256},
}

#: the names of Sampling's fields
FIELDS = frozenset(Sampling.__struct_fields__)


def unknown_fields(names: Iterable[str], what: str = "sampling option") -> str:
    """The sentence that refuses the names among ``names`` that are not Sampling's fields ("" when
    every one is): "unknown sampling option(s) ['temprature']: use some of [...]". Each front end
    raises it as its own error."""
    unknown = set(names) - FIELDS
    if not unknown:
        return ""
    return f"unknown {what}(s) {sorted(unknown)}: use some of {sorted(FIELDS)}"


def for_front_end(front_end: str, **fields: object) -> Sampling:
    """A checked Sampling: the front end's defaults, overridden by ``fields``; a None value means
    "absent" (the row's default applies). Raises ValueError naming the field (an unknown name
    included)."""
    unknown = unknown_fields(fields, "field")
    if unknown:
        raise ValueError(f"sampling: {unknown}")
    merged: dict[str, object] = dict(DEFAULTS[front_end])
    merged.update((key, value) for key, value in fields.items() if value is not None)
    try:
        built = msgspec.convert(merged, Sampling)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling: {exc}") from None
    return check(built)


@dataclass(frozen=True)
class AnswerDefaults:
    """The answer settings a new chat-window conversation starts with."""

    temperature: float
    max_tokens: int | None
    repeat_penalty: float


def _number(row: dict[str, object], key: str) -> float:
    value = row[key]
    assert isinstance(value, (int, float))
    return float(value)


def new_conversation(base_model: bool = False) -> AnswerDefaults:
    """ "chat_window"'s answer settings, or "chat_window_base"'s for a base model (a model without
    a chat template)."""
    row = DEFAULTS["chat_window_base" if base_model else "chat_window"]
    limit = row["max_tokens"]
    return AnswerDefaults(
        temperature=_number(row, "temperature"),
        max_tokens=limit if isinstance(limit, int) else None,
        repeat_penalty=_number(row, "repeat_penalty"),
    )
