"""A conversation as a file (Markdown for people, JSON for programs) and the search over
conversations: Qt-free, like transcript.py, so the tests check the text without a display.

The JSON keeps what the store keeps (roles, texts, times, each answer's statistics and the
conversation's answer settings); the Markdown reads as the transcript does (who wrote what).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.conversations.store import Conversation, Message

#: the file dialog's choices, and the suffix each writes
FORMATS = {"Markdown (*.md)": ".md", "JSON (*.json)": ".json"}
JSON_FORMAT = "timeshare-conversation"  # the "format" field of an exported JSON file
JSON_VERSION = 1


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="seconds")


def as_markdown(
    conversation: Conversation, messages: Iterable[Message], display_name: Callable[[str], str]
) -> str:
    """The conversation as Markdown: its title, the model, then each message under who wrote it
    (an answer is signed by the model that wrote it, as the transcript does)."""
    title = conversation.title or "Conversation"
    lines = [
        f"# {title}",
        "",
        f"*Model: {display_name(conversation.model_id)} · {_when(conversation.created)}*",
    ]
    if conversation.system_prompt.strip():
        lines += ["", f"**System prompt:** {conversation.system_prompt.strip()}"]
    for msg in messages:
        if msg.role == "system":
            continue
        if msg.role == "user":
            who = "You"
        else:
            who = display_name((msg.stats.model_id if msg.stats is not None else "") or conversation.model_id)
        text = msg.content if msg.content.strip() else "*(no text)*"
        lines += ["", f"## {who}", "", text]
        if msg.role == "assistant" and not msg.complete:
            lines += ["", "*(interrupted)*"]
    return "\n".join(lines) + "\n"


def as_json(conversation: Conversation, messages: Iterable[Message]) -> str:
    """The conversation as JSON: what the store keeps, with times in ISO 8601 (UTC)."""
    data = {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "id": conversation.id,
        "title": conversation.title,
        "model": conversation.model_id,
        "created": _when(conversation.created),
        "updated": _when(conversation.updated),
        "answer_settings": {
            "system_prompt": conversation.system_prompt,
            "temperature": conversation.temperature,
            "max_tokens": conversation.max_tokens,
            "repeat_penalty": conversation.repeat_penalty,
        },
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "created": _when(m.created),
                "complete": m.complete,
                **({"stats": m.stats.to_json()} if m.stats is not None else {}),
            }
            for m in messages
        ],
    }
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def file_name(conversation: Conversation, suffix: str) -> str:
    """A file name made of the title ("What is a GPU.md"): no path separators or odd characters."""
    stem = re.sub(r"[^\w\- .,()]+", "", conversation.title or "conversation").strip(" .") or "conversation"
    return stem[:60] + suffix


def export(
    path: Path,
    conversation: Conversation,
    messages: Sequence[Message],
    display_name: Callable[[str], str],
) -> Path:
    """Write the conversation to ``path``: JSON for a .json file, else Markdown (.md added when
    the name has no suffix). Atomic: a file that was there stays whole until the new one is
    complete. Returns the path written; raises OSError."""
    if not path.suffix:
        path = path.with_suffix(".md")
    if path.suffix.lower() == ".json":
        text = as_json(conversation, messages)
    else:
        text = as_markdown(conversation, messages, display_name)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def matches(query: str, conversation: Conversation, messages: Iterable[Message]) -> bool:
    """Whether a conversation matches the search: every word of ``query`` is in its title or its
    messages (any case). An empty query matches everything."""
    needles = query.casefold().split()
    if not needles:
        return True
    haystack = "\n".join([conversation.title, *(m.content for m in messages)]).casefold()
    return all(n in haystack for n in needles)
