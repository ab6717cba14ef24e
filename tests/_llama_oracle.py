"""The oracle many tests compare against: what plain llama-cpp-python answers, with nothing of
Timeshare in between."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp


def plain_completions(
    path: Path, prompts: Sequence[str], max_tokens: int, *, n_ctx: int = 2048, **kwargs: Any
) -> list[str]:
    """What a fresh plain Llama answers (create_completion; greedy unless ``kwargs`` say otherwise),
    one per prompt, each alone: the context is reset before each (else create_completion reuses
    the BOS token the prompts share: other batches). Where create_completion went past
    ``max_tokens`` to finish a character of several tokens, the answer is cut as the worker cuts it
    (issue 45: never past the limit; the cut character dropped)."""
    kwargs.setdefault("temperature", 0.0)
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, verbose=False)
    answers: list[str] = []
    try:
        for prompt in prompts:
            llm.reset()
            out = llm.create_completion(prompt, max_tokens=max_tokens, **kwargs)
            text = str(out["choices"][0]["text"])  # type: ignore[index]
            if int(out["usage"]["completion_tokens"]) > max_tokens:  # type: ignore[index]
                assert len(text[-1].encode()) > 1, text  # it went on only to finish this character
                text = text[:-1]
            answers.append(text)
    finally:
        llm.close()
    return answers
