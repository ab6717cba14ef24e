"""The slash commands of ``timeshare run``'s REPL, as Ollama users type them.

``/?`` or ``/help`` lists them; ``/set parameter NAME VALUE`` sets a sampling parameter for the
turns that follow (Ollama's names: ``num_predict`` is max_tokens), ``/set system TEXT`` the
system message, ``/show`` what is set (and the model), ``/clear`` forgets the conversation,
``/bye`` exits. A line that starts with ``/`` and is none of these is refused, never sent to the
model (``//text`` sends ``/text``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HELP = """Available commands:
  /set parameter NAME VALUE   set a parameter for the next answers (/set parameter to list them)
  /set system TEXT            set the system message (/set system with no text: none)
  /show                       show the model, the parameters and the system message
  /clear                      forget the conversation (the parameters and system message stay)
  /bye                        exit (also /exit, Ctrl-D)
  /?, /help                   this help
Ctrl-C stops an answer. Begin a message with // to send one that starts with /.
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _stop(text: str) -> list[str]:
    return [text]


#: Ollama's parameter name -> (the request field, how the value is read)
PARAMETERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "num_predict": ("max_tokens", _positive_int),
    "max_tokens": ("max_tokens", _positive_int),
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "seed": ("seed", int),
    "stop": ("stop", _stop),
    "repeat_penalty": ("repeat_penalty", float),
    "repeat_last_n": ("repeat_last_n", int),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}


@dataclass
class Session:
    """What the REPL's commands change: the parameters, the system message, the conversation."""

    parameters: dict[str, Any] = field(default_factory=dict)  # request field -> value
    system: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # content: text, or parts with images

    def request_messages(self, text: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.messages, {"role": "user", "content": text}]


@dataclass(frozen=True)
class Outcome:
    """What a line means: ``send`` (text for the model), ``exit``, or ``output`` to print."""

    send: str | None = None
    output: str = ""
    exit: bool = False
    cleared: bool = False


def handle(line: str, session: Session, describe_model: Callable[[], str]) -> Outcome:
    """What ``line`` (stripped, not empty) does; changes ``session`` for /set and /clear."""
    if line.startswith("//"):
        return Outcome(send=line[1:])
    if not line.startswith("/"):
        return Outcome(send=line)
    command, _, rest = line.partition(" ")
    rest = rest.strip()
    if command in ("/?", "/help"):
        return Outcome(output=HELP)
    if command in ("/bye", "/exit"):
        return Outcome(exit=True)
    if command == "/clear":
        session.messages.clear()
        return Outcome(output="Cleared the conversation.\n", cleared=True)
    if command == "/show":
        return Outcome(output=_show(session, describe_model, rest))
    if command == "/set":
        return Outcome(output=_set(session, rest))
    return Outcome(output=f"Unknown command {command!r}: type /? for the commands.\n")


def _set(session: Session, rest: str) -> str:
    what, _, value = rest.partition(" ")
    if what == "system":
        session.system = value.strip()
        return "Set the system message.\n" if session.system else "Cleared the system message.\n"
    if what != "parameter":
        return "Use /set parameter NAME VALUE or /set system TEXT.\n"
    name, _, raw = value.strip().partition(" ")
    raw = raw.strip()
    if not name or name not in PARAMETERS or not raw:
        names = ", ".join(PARAMETERS)
        return f"Use /set parameter NAME VALUE with NAME one of: {names}.\n"
    key, parse = PARAMETERS[name]
    try:
        session.parameters[key] = parse(raw)
    except ValueError as exc:
        return f"{name}: {raw!r} is not a valid value ({exc}).\n"
    return f"Set parameter {name!r} to {raw!r}.\n"


def _show(session: Session, describe_model: Callable[[], str], what: str) -> str:
    parts = []
    if what in ("", "info"):
        parts.append(describe_model())
    if what in ("", "parameters"):
        shown = {k: v for k, v in session.parameters.items()}
        parts.append("Parameters: " + (json.dumps(shown) if shown else "the defaults") + "\n")
    if what in ("", "system"):
        parts.append(f"System message: {session.system or '(none)'}\n")
    if not parts:
        return "Use /show, /show info, /show parameters or /show system.\n"
    return "".join(parts)
