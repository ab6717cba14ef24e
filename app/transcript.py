"""What the chat window writes, as text: the transcript (Markdown) and the line under an answer.

Qt-free, like menu_model: the window hands in the stored messages and a way to name a model, and
shows what comes back; the tests check the text without a display.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core import words
from ..core.sampling import AnswerDefaults, new_conversation

if TYPE_CHECKING:
    from ..core.conversations.store import AnswerStats, Conversation, Message

#: between the messages of the transcript
BLOCK_SEPARATOR = "\n\n---\n\n"
#: the transcript when there is no conversation to show
NO_CONVERSATION = "*No conversation yet: press **New** or start typing.*"


@dataclass(frozen=True)
class Block:
    """One message of the transcript: what is shown, and what its "Copy" link copies."""

    markdown: str  # who wrote it, the text, the statistics line
    text: str  # the message itself
    edit_id: int | None = None  # a user message's id in the store: its "Edit" link edits and resends it
    #: a base model's text continuation: (the user's text, the model's continuation of it), shown
    #: as one text after ``markdown`` (who continued it), with ``footer`` (the statistics) under it
    continued: tuple[str, str] | None = None
    footer: str = ""
    #: a user message's images (issue 41), by :func:`image_key`: shown as thumbnails
    images: tuple[str, ...] = ()


def image_key(data: bytes) -> str:
    """The name a message's image is shown by (its content's hash)."""
    return hashlib.sha256(data).hexdigest()[:20]


def _md_escape(text: str) -> str:
    """Plain text that Markdown shows as it is (a stop string can hold `*`, `_` or a backslash)."""
    return "".join(f"\\{c}" if c in "\\`*_[]<>#" else c for c in text)


def shown_text(text: str) -> str:
    """A stop string as people can read it: a newline as \\n, in double quotes ("\\nUser:")."""
    return '"' + text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t") + '"'


def empty_answer_note(stats: AnswerStats) -> str:
    """Why an answer that ended has no text; "" when it was not left empty by the model."""
    if stats.finish_reason == "stop" and stats.stop:
        return f"the model stopped at once: it produced the stop string {shown_text(stats.stop)}"
    if stats.finish_reason == "stop":
        return "the model ended its answer at once (it produced its end-of-turn token)"
    if stats.finish_reason == "length":
        return "the token limit was reached before any text: raise Longest answer in Answer settings"
    return ""


def answer_block(
    who: str, text: str, *, complete: bool = True, stats: AnswerStats | None = None, gpu: bool = True
) -> str:
    """One answer: who wrote it, its text ("…" while there is none; why, once it ended empty),
    whether it was cut off, and its statistics line."""
    note = empty_answer_note(stats) if stats is not None and complete and not text.strip() else ""
    if note:
        text = (
            f"*(no answer: {_md_escape(note)}; send again, reword the message or change the Answer settings)*"
        )
    block = f"**{who}**\n\n{text or '…'}"
    if not complete:
        block += "\n\n*(interrupted)*"
    if stats is not None:
        block += f"\n\n*{_md_escape(answer_line(stats, why_empty=not note, gpu=gpu))}*"
    return block


def continued_by(who: str) -> str:
    """Over a base model's continuation: who continued the text."""
    return f"**{who}** continued your text:"


def continuation_block(
    who: str,
    prompt: str,
    continuation: str,
    *,
    edit_id: int | None = None,
    complete: bool = True,
    stats: AnswerStats | None = None,
    gpu: bool = True,
    rate: str = "",
) -> Block:
    """A base model's answer as what it is: the user's text continued (one text, the continuation
    marked), its statistics line under it."""
    footer = "" if complete else "*(interrupted)*"
    if stats is not None:
        footer = "\n\n".join(x for x in (footer, f"*{_md_escape(answer_line(stats, gpu=gpu))}*") if x)
    if rate:
        footer = f"*{rate}*"
    return Block(continued_by(who), prompt + continuation, edit_id, (prompt, continuation or "…"), footer)


def history_blocks(
    messages: Iterable[Message],
    model_id: str,
    display_name: Callable[[str], str],
    *,
    gpu: bool = True,
    base: Callable[[str], bool] = lambda _model: False,
) -> list[Block]:
    """The stored messages of a conversation (system messages left out). An answer is signed with
    the model that wrote it (from its stats), else with the conversation's ``model_id``;
    ``display_name`` turns a model id into what people see. A message followed by the answer of
    a base model (``base``: no chat template) is one block, the text continued."""
    shown_messages = [m for m in messages if m.role != "system"]
    blocks: list[Block] = []
    skip = False
    for i, msg in enumerate(shown_messages):
        if skip:
            skip = False
            continue
        nxt = shown_messages[i + 1] if i + 1 < len(shown_messages) else None
        if msg.role == "user" and nxt is not None and nxt.role == "assistant":
            author = (nxt.stats.model_id if nxt.stats is not None else "") or model_id
            if base(author):
                blocks.append(
                    continuation_block(
                        display_name(author),
                        msg.content,
                        nxt.content,
                        edit_id=msg.id,
                        complete=nxt.complete,
                        stats=nxt.stats,
                        gpu=gpu,
                    )
                )
                skip = True
                continue
        if msg.role == "user":
            keys = tuple(image_key(i.data) for i in msg.images)
            blocks.append(Block(f"**You**\n\n{msg.content}", msg.content, msg.id, images=keys))
            continue
        author = (msg.stats.model_id if msg.stats is not None else "") or model_id
        shown = answer_block(
            display_name(author), msg.content, complete=msg.complete, stats=msg.stats, gpu=gpu
        )
        blocks.append(Block(shown, msg.content))
    return blocks


def history_markdown(
    messages: Iterable[Message], model_id: str, display_name: Callable[[str], str], *, gpu: bool = True
) -> str:
    """:func:`history_blocks` as one Markdown text."""
    blocks = history_blocks(messages, model_id, display_name, gpu=gpu)
    return BLOCK_SEPARATOR.join(b.markdown for b in blocks)


def live_block(who: str, partial: str, rate: str = "") -> Block:
    """The answer streaming now, with its live rate ("42 tokens · 18.3 tokens/s") under it."""
    shown = answer_block(who, partial)
    return Block(shown + (f"\n\n*{rate}*" if rate else ""), partial)


def live_rate(pieces: int, seconds: float) -> str:
    """The live line under a streaming answer: "42 tokens · 18.3 tokens/s" (a streamed piece is a
    token, but for the rare piece that completes several)."""
    if pieces < 2 or seconds <= 0:
        return f"{pieces} {'token' if pieces == 1 else 'tokens'}"
    return f"{pieces} tokens · {(pieces - 1) / seconds:.1f} tokens/s"


def with_live_answer(history: str, who: str, partial: str) -> str:
    """The history followed by the answer that is streaming now."""
    live = answer_block(who, partial)
    return BLOCK_SEPARATOR.join([history, live]) if history else live


def answer_line(stats: AnswerStats, *, why_empty: bool = True, gpu: bool = True) -> str:
    """The line under an answer (and in the status bar when it ends): time to the first token,
    decode rate, what the GPU switch cost ("switch" and "its turn" where ``gpu`` is False), and why
    it ended when it did not end by itself (and, with ``why_empty``, why no text came when none
    did)."""
    if stats.finish_reason == "error":
        return f"failed: {stats.error}" if stats.error else "failed"
    if stats.finish_reason == "cancelled" and stats.ttft_ms is None:
        return "stopped"
    parts = []
    if stats.ttft_ms is not None:
        parts.append(f"first token {stats.ttft_ms:.0f} ms")
    no_text = stats.ttft_ms is None and stats.finish_reason in ("stop", "length")
    if stats.tokens_per_s > 0 or (stats.ttft_ms is not None and stats.completion_tokens > 1):
        parts.append(f"{stats.tokens_per_s:.1f} tokens/s")  # a rate needs two tokens
    elif stats.ttft_ms is not None:
        parts.append(f"{stats.completion_tokens} {'token' if stats.completion_tokens == 1 else 'tokens'}")
    switch = words.switch_word(gpu)
    if stats.switched:
        detail = f"restore {stats.restore_ms:.0f} ms"
        if stats.wait_ms:
            detail += f", {words.waited_for(stats.wait_ms, gpu)}"
        parts.append(f"{switch} {stats.wait_ms + stats.restore_ms:.0f} ms ({detail})")
    elif stats.prewoken:
        parts.append(f"no {switch} at send: restored while you typed")
    else:
        parts.append(f"no {switch}")
    if stats.finish_reason == "cancelled":
        parts.append("stopped")
    elif no_text and why_empty:
        parts.append(f"no text: {empty_answer_note(stats)}")
    elif stats.finish_reason == "length":
        parts.append("hit the token limit")
    return " · ".join(parts)


def settings_summary(conversation: Conversation) -> str:
    """A conversation's answer settings in a few words: "greedy · up to 512 tokens · repetition
    guard 1.3 · system prompt"."""
    temperature = "greedy" if conversation.temperature == 0 else f"temperature {conversation.temperature:g}"
    limit = conversation.max_tokens
    parts = [temperature, f"up to {limit} tokens" if limit else "no length limit"]
    if conversation.repeat_penalty > 1.0:
        parts.append(f"repetition guard {conversation.repeat_penalty:g}")
    if conversation.system_prompt.strip():
        parts.append("system prompt")
    return " · ".join(parts)


def switched_defaults(conversation: Conversation, base_model: bool) -> AnswerDefaults | None:
    """The answer settings a conversation gets when its model changes to a base model
    (``base_model``) or from one: the new kind's defaults, if it still has the other kind's (a
    setting the user chose is kept); None when nothing changes."""
    now = AnswerDefaults(conversation.temperature, conversation.max_tokens, conversation.repeat_penalty)
    other, new = new_conversation(not base_model), new_conversation(base_model)
    return new if now == other and now != new else None


#: the first-run suggestions: a question for a chat model, a text to continue for a base model
TRY_CHAT = "What are the three primary colours? Answer in one sentence."
TRY_BASE = "The three primary colours are"


def first_run(
    models: Iterable[tuple[str, str, bool]], *, gpu: bool = True
) -> tuple[str, list[tuple[str, str]]]:
    """What an empty transcript offers: for each model (id, name, whether it is a base model) a
    prompt that suits it, as a ``try:N`` link, and what switching between them shows. Returns the
    Markdown and the (model id, prompt) of each link."""
    lines = ["**Try a model** — click a prompt to send it:", ""]
    prompts: list[tuple[str, str]] = []
    for model_id, name, base in models:
        prompt = TRY_BASE if base else TRY_CHAT
        what = f"Let {name} continue" if base else f"Ask {name}"
        kind = "a base model: it continues your text" if base else "a chat model: it answers"
        lines.append(f"- [{what}: “{prompt}”](try:{len(prompts)}) — {kind}")
        prompts.append((model_id, prompt))
    if len(prompts) > 1:
        lines += [
            "",
            f"Then try another: the models take turns{' on the GPU' if gpu else ''}, and the line under "
            f"each answer says what the {words.switch_word(gpu)} cost. Each gets its own conversation: a "
            "base model continues whatever text it is given, a chat model answers it.",
        ]
    lines += ["", "Or type a message below (a new conversation: **New**)."]
    return "\n".join(lines), prompts


def failure_line(message: str) -> str:
    """The status bar when an answer failed."""
    return f"The answer failed: {message} — press Retry to try again"
