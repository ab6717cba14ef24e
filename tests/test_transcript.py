"""The chat window's text without a window: app/transcript.py and the AnswerStats it renders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from timeshare.app.transcript import (
    BLOCK_SEPARATOR,
    answer_block,
    answer_line,
    failure_line,
    history_markdown,
    settings_summary,
    with_live_answer,
)
from timeshare.core.conversations.store import AnswerStats, Conversation, Message

NAMES = {"smol": "SmolLM2", "gemma": "Gemma"}


def name(model_id: str) -> str:
    return NAMES.get(model_id, model_id)


def msg(n: int, role: str, content: str, complete: bool = True, stats: AnswerStats | None = None) -> Message:
    return Message(n, "c1", role, content, 0.0, complete, stats)  # type: ignore[arg-type]


def test_the_module_does_not_load_qt() -> None:
    code = "import sys, timeshare.app.transcript; print(sorted(m for m in sys.modules if 'PySide6' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("stats", "line"),
    [
        (AnswerStats("error", error="the worker crashed"), "failed: the worker crashed"),
        (AnswerStats("error"), "failed"),
        (AnswerStats("cancelled"), "stopped"),
        (
            AnswerStats(
                "stop", ttft_ms=812.4, tokens_per_s=41.26, switched=True, wait_ms=120.0, restore_ms=380.2
            ),
            "first token 812 ms · 41.3 tokens/s · "
            "GPU switch 500 ms (restore 380 ms, waited 120 ms for the GPU)",
        ),
        (
            AnswerStats("length", ttft_ms=90.0, tokens_per_s=50.0, switched=True, restore_ms=300.0),
            "first token 90 ms · 50.0 tokens/s · GPU switch 300 ms (restore 300 ms) · hit the token limit",
        ),
        (
            AnswerStats("stop", ttft_ms=35.0, tokens_per_s=60.0, prewoken=True),
            "first token 35 ms · 60.0 tokens/s · no GPU switch at send: restored while you typed",
        ),
        (
            AnswerStats("cancelled", ttft_ms=35.0, tokens_per_s=60.0),
            "first token 35 ms · 60.0 tokens/s · no GPU switch · stopped",
        ),
        # one token: no rate (it needs two)
        (
            AnswerStats("stop", ttft_ms=35.0, completion_tokens=1),
            "first token 35 ms · 1 token · no GPU switch",
        ),
        # no text at all: no "0.0 tokens/s", but why
        (
            AnswerStats("stop", completion_tokens=3, stop="\nUser:"),
            'no GPU switch · no text: the model stopped at once: it produced the stop string "\\nUser:"',
        ),
        (
            AnswerStats("stop"),
            "no GPU switch · no text: the model ended its answer at once (it produced its end-of-turn token)",
        ),
    ],
)
def test_answer_line(stats: AnswerStats, line: str) -> None:
    assert answer_line(stats) == line


def test_history_signs_each_answer_with_the_model_that_wrote_it() -> None:
    stats = AnswerStats("stop", model_id="gemma", ttft_ms=10.0, tokens_per_s=5.0)
    messages = [
        msg(1, "system", "be brief"),
        msg(2, "user", "hi"),
        msg(3, "assistant", "Hello!", stats=stats),  # written by gemma before the model changed
        msg(4, "user", "and now?"),
        msg(5, "assistant", "Half an ans", complete=False),  # cut off: no stats
        msg(6, "assistant", "", stats=AnswerStats("cancelled", model_id="smol")),
    ]
    assert history_markdown(messages, "smol", name).split(BLOCK_SEPARATOR) == [
        "**You**\n\nhi",
        f"**Gemma**\n\nHello!\n\n*{answer_line(stats)}*",
        "**You**\n\nand now?",
        "**SmolLM2**\n\nHalf an ans\n\n*(interrupted)*",
        "**SmolLM2**\n\n…\n\n*stopped*",
    ]
    assert history_markdown([], "smol", name) == ""


def test_an_empty_answer_says_why() -> None:
    stop = AnswerStats("stop", model_id="gemma", completion_tokens=3, stop="\nUser:")
    block = history_markdown([msg(1, "user", "hi"), msg(2, "assistant", "", stats=stop)], "gemma", name)
    answer = block.split(BLOCK_SEPARATOR)[1]
    assert "…" not in answer and "0.0 tokens/s" not in answer
    # the stop string as people read it, escaped for Markdown (its backslash shows)
    assert (
        '*(no answer: the model stopped at once: it produced the stop string "\\\\nUser:"; send again, '
        "reword the message or change the Answer settings)*" in answer
    )
    assert answer.endswith("*no GPU switch*")  # the note is not said twice
    eot = answer_block("SmolLM2", " \n", stats=AnswerStats("stop"))
    assert "ended its answer at once (it produced its end-of-turn token)" in eot
    # a stop string holding Markdown is shown as it is
    stars = answer_block("SmolLM2", "", stats=AnswerStats("stop", stop="**"))
    assert 'stop string "\\*\\*"' in stars
    # text, a stopped or an unfinished answer: no note
    assert "no answer" not in answer_block("SmolLM2", "Hi", stats=AnswerStats("stop", ttft_ms=1.0))
    assert "no answer" not in answer_block("SmolLM2", "", stats=AnswerStats("cancelled"))
    assert "no answer" not in answer_block("SmolLM2", "", complete=False)


def test_settings_summary() -> None:
    conv = Conversation("c1", "smol", "", 0.0, 0.0)
    assert settings_summary(conv) == "greedy · up to 1024 tokens"  # the chat window's default
    conv = Conversation("c1", "smol", "", 0.0, 0.0, max_tokens=None, repeat_penalty=1.3)
    assert settings_summary(conv) == "greedy · no length limit · repetition guard 1.3"
    conv = Conversation("c1", "smol", "", 0.0, 0.0, system_prompt="Be brief.", temperature=0.7, max_tokens=64)
    assert settings_summary(conv) == "temperature 0.7 · up to 64 tokens · system prompt"


def test_the_live_answer_follows_the_history() -> None:
    assert with_live_answer("", "SmolLM2", "") == "**SmolLM2**\n\n…"
    assert with_live_answer("**You**\n\nhi", "SmolLM2", "Hel") == (
        "**You**\n\nhi" + BLOCK_SEPARATOR + answer_block("SmolLM2", "Hel")
    )
    assert answer_block("SmolLM2", "Hel") == "**SmolLM2**\n\nHel"


def test_failure_line() -> None:
    assert failure_line("no GPU") == "The answer failed: no GPU — press Retry to try again"


def test_answer_stats_round_trip_through_json() -> None:
    stats = AnswerStats(
        "length",
        model_id="smol",
        prompt_tokens=20,
        completion_tokens=40,
        prompt_tokens_evaluated=7,
        switched=True,
        wait_ms=1.5,
        restore_ms=2.5,
        first_token_ms=3.5,
        ttft_ms=4.5,
        elapsed_ms=100.0,
        tokens_per_s=30.25,
        prewoken=False,
        stop="\nUser:",
    )
    assert AnswerStats.from_json(json.loads(json.dumps(stats.to_json()))) == stats
    failed = AnswerStats("error", model_id="smol", error="boom", error_code="model_unavailable")
    assert AnswerStats.from_json(json.loads(json.dumps(failed.to_json()))) == failed


def test_answer_stats_from_older_or_damaged_rows() -> None:
    # a row as the first versions wrote it (a plain dict, no error fields)
    old = {
        "model_id": "smol",
        "finish_reason": "stop",
        "prompt_tokens": 20,
        "completion_tokens": 3,
        "prompt_tokens_evaluated": 7,
        "switched": True,
        "wait_ms": 3,
        "restore_ms": 2.0,
        "first_token_ms": 1.0,
        "ttft_ms": None,
        "elapsed_ms": 9.0,
        "tokens_per_s": 12.5,
    }
    got = AnswerStats.from_json(old)
    assert got == AnswerStats(
        "stop",
        model_id="smol",
        prompt_tokens=20,
        completion_tokens=3,
        prompt_tokens_evaluated=7,
        switched=True,
        wait_ms=3.0,
        restore_ms=2.0,
        first_token_ms=1.0,
        elapsed_ms=9.0,
        tokens_per_s=12.5,
    )
    assert got is not None and isinstance(got.wait_ms, float)
    damaged = {
        "finish_reason": "stop",
        "switched": "yes",
        "tokens_per_s": "fast",
        "ttft_ms": True,
        "error": 3,
    }
    assert AnswerStats.from_json(damaged) == AnswerStats("stop")
    assert AnswerStats.from_json({"ttft_ms": float("inf"), "finish_reason": "stop"}) == AnswerStats("stop")
    for nothing in ({}, {"finish_reason": None}, [], None, "stop"):
        assert AnswerStats.from_json(nothing) is None
