"""Limits on a GBNF grammar, checked before llama.cpp sees it (issue 38): a grammar llama.cpp
cannot build in bounded time and stack is refused with a sentence naming the limit.

llama.cpp's parser (``llama_grammar_parser``) descends recursively into every parenthesised
group: 10^5 nested groups overflowed the worker's stack (a segfault, from a 200 KB request). Its
left-recursion check descends along chains of rule references the same way. Its repetitions
``x{m,n}`` copy the repeated symbols once per repetition (a long literal repeated 2,000 times is
millions of elements). And building the grammar's first stacks compares each new stack with
every one before it: a root of 100,000 alternatives took minutes of one uncancellable C call
(the worker answered nothing else meanwhile). So the grammar text is scanned here, iteratively,
with llama.cpp's lexical rules (literals, character classes, tokens, comments), and refused when
it is longer than ``MAX_GRAMMAR_BYTES``, nests groups deeper than ``MAX_GRAMMAR_NESTING``, would
expand to more than ``MAX_GRAMMAR_RULES`` rules or ``MAX_GRAMMAR_ELEMENTS`` symbols, or holds more
than ``MAX_GRAMMAR_ALTERNATIVES`` alternatives. The API checks a request's grammar (400); the
worker checks again before ``llama_sampler_init_grammar``, whatever sent it.

The estimate follows llama.cpp's expansion (``parse_sequence``): a group is one synthesized rule
referenced by one symbol; ``*``, ``+``, ``?`` add one rule; ``{m,n}`` copies the repeated
symbols ``m - 1`` times and adds ``n - m`` rules (one when unbounded), each holding a copy; a
maximum over 2,000 becomes unbounded, a minimum over 2,000 is refused by llama.cpp itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: the longest grammar text (bytes, UTF-8)
MAX_GRAMMAR_BYTES = 256 * 1024
#: the deepest nesting of parenthesised groups (llama.cpp's parser recurses once per level)
MAX_GRAMMAR_NESTING = 1100
#: rules after llama.cpp's expansion (named, groups, repetitions): its left-recursion check
#: recurses along chains of them
MAX_GRAMMAR_RULES = 5_000
#: symbols after llama.cpp's expansion of repetitions
MAX_GRAMMAR_ELEMENTS = 1_000_000
#: alternatives (``|``) in all: each may start a stack of its own
MAX_GRAMMAR_ALTERNATIVES = 2_000
#: llama.cpp's MAX_REPETITION_THRESHOLD: a larger maximum is unbounded, a larger minimum refused
LLAMA_REPETITION_THRESHOLD = 2000


class _Malformed(Exception):
    """An unterminated literal, class or token: llama.cpp's parser reads to the end of the text and
    refuses it, so the scan stops there too. Other malformed text is skipped (the scan goes on,
    counting what follows: a limit can only be over-counted, never passed by hiding text)."""


class GrammarLimitError(ValueError):
    """A grammar over one of the limits (the message names it and says what to do)."""


@dataclass(frozen=True)
class GrammarSize:
    """What the scan found (the figures the limits apply to)."""

    bytes: int
    nesting: int
    rules: int
    elements: int
    alternatives: int


def _refuse(where: str, what: str) -> GrammarLimitError:
    return GrammarLimitError(f"{where}: {what}")


def measure_gbnf(text: str, where: str = "grammar") -> GrammarSize:
    """Scan ``text`` (see the module docstring); raises GrammarLimitError at the first limit
    passed (so the scan itself stays bounded). Syntax errors are llama.cpp's to report (see
    ``_Malformed``)."""
    size = len(text.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise _refuse(
            where,
            f"the grammar is {size} bytes; Timeshare takes at most {MAX_GRAMMAR_BYTES} "
            "(MAX_GRAMMAR_BYTES): make it smaller",
        )
    n = len(text)
    i = 0
    # per open group: the symbols in it so far; the last symbol's size (what a repetition copies)
    frames: list[int] = [0]
    last = 0
    depth = max_depth = 0
    rules = elements = alternatives = 0

    def add(count: int) -> None:
        nonlocal elements
        elements += count
        frames[-1] += count
        if elements > MAX_GRAMMAR_ELEMENTS:
            raise _refuse(
                where,
                f"the grammar expands to more than {MAX_GRAMMAR_ELEMENTS} symbols (MAX_GRAMMAR_ELEMENTS; "
                "repetitions {m,n} copy what they repeat): repeat less",
            )

    def count_rules(count: int) -> None:
        nonlocal rules
        rules += count
        if rules > MAX_GRAMMAR_RULES:
            raise _refuse(
                where,
                f"the grammar expands to more than {MAX_GRAMMAR_RULES} rules (MAX_GRAMMAR_RULES; "
                "each group, repetition and rule counts): simplify it",
            )

    def closing(at: int, quote: str) -> int:
        """The index after the literal/class that opened before ``at`` and ends at ``quote``."""
        j = at
        while j < n:
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c == quote:
                return j + 1
            j += 1
        raise _Malformed

    try:
        while i < n:
            c = text[i]
            if c in " \t\r\n":
                i += 1
            elif c == "#":  # a comment ends at a line end, as llama.cpp's parse_space reads it
                while i < n and text[i] not in "\r\n":
                    i += 1
            elif c == '"':
                j = closing(i + 1, '"')
                last = max(1, j - i - 2)  # roughly one symbol per character (escapes count more)
                add(last)
                i = j
            elif c == "[":
                j = closing(i + 1, "]")
                last = max(1, j - i - 2)
                add(last)
                i = j
            elif c in "<!":
                j = text.find(">", i)
                if j < 0:
                    raise _Malformed
                last = 1
                add(1)
                i = j + 1
            elif c == ":" and text.startswith("::=", i):
                count_rules(1)  # a named rule (its name was counted as a symbol: harmless)
                i += 3
            elif c == "|":
                alternatives += 1
                if alternatives > MAX_GRAMMAR_ALTERNATIVES:
                    raise _refuse(
                        where,
                        f"the grammar has more than {MAX_GRAMMAR_ALTERNATIVES} alternatives "
                        "(MAX_GRAMMAR_ALTERNATIVES): each can start a parse of its own; use fewer",
                    )
                i += 1
            elif c == "(":
                depth += 1
                if depth > MAX_GRAMMAR_NESTING:
                    raise _refuse(
                        where,
                        f"groups ( ) nest more than {MAX_GRAMMAR_NESTING} deep (MAX_GRAMMAR_NESTING): "
                        "llama.cpp's parser would run out of stack; flatten it with named rules",
                    )
                max_depth = max(max_depth, depth)
                count_rules(1)
                frames.append(0)
                i += 1
            elif c == ")":
                if depth == 0:  # llama.cpp refuses it; the scan goes on (it only over-counts)
                    i += 1
                    continue
                depth -= 1
                inner = frames.pop()
                frames[-1] += inner
                last = 1  # a group is one rule reference
                add(1)
                i += 1
            elif c in "*+?":
                count_rules(1)
                add(last)  # the repetition rule holds a copy
                i += 1
            elif c == "{":
                j = text.find("}", i)
                body = re.sub(r"\s+", "", text[i + 1 : j]) if j > 0 else ""
                low_s, _, high_s = body.partition(",")
                if j < 0 or not low_s.isdigit() or (high_s and not high_s.isdigit()) or len(body) > 40:
                    i += 1  # llama.cpp refuses it; the scan goes on (it only over-counts)
                    continue
                low = int(low_s)
                high = int(high_s) if high_s else (low if "," not in body else -1)
                if low > LLAMA_REPETITION_THRESHOLD:
                    raise _refuse(
                        where,
                        f"{text[i : j + 1]}: llama.cpp repeats at most {LLAMA_REPETITION_THRESHOLD} times",
                    )
                if high > LLAMA_REPETITION_THRESHOLD:
                    high = -1  # llama.cpp makes it unbounded
                optional = 1 if high < 0 else max(0, high - low)
                count_rules(optional)
                add(last * (max(0, low - 1) + optional))
                i = j + 1
            else:
                j = i
                while j < n and (text[j].isalnum() or text[j] in "-_."):
                    j += 1
                if j == i:
                    j = i + 1  # something llama.cpp refuses itself: count it and go on
                last = 1
                add(1)
                i = j
    except _Malformed:
        pass  # llama.cpp's parser refuses it, with its own message: nothing to bound
    return GrammarSize(size, max_depth, rules, elements, alternatives)


def check_gbnf(text: str, where: str = "grammar") -> None:
    """Refuse a grammar over the limits (GrammarLimitError naming ``where`` and the limit)."""
    measure_gbnf(text, where)
