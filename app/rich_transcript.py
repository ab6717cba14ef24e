"""The chat transcript as HTML for the QTextBrowser: each message's Markdown (Qt's own reader) with
its code blocks highlighted by Pygments, a "Copy" link under each message and one over each code
block, in the colours of the desktop's light or dark scheme.

The links are ``copy:N`` anchors: the window keeps the texts (:attr:`Rendered.copies`) and puts
text N on the clipboard when one is clicked; a message of the user's also has an ``edit:ID`` link
(its id in the store): the window puts it back in the input box to be changed and sent again.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound
from PySide6.QtGui import QTextDocument

from .transcript import Block

#: a fenced code block: ```lang ... ``` (the closing fence on its own line, or the end of the text
#: while an answer still streams)
FENCE = re.compile(r"^```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)
_BODY = re.compile(r"<body[^>]*>(.*)</body>", re.DOTALL)
COPY = "Copy"
COPY_CODE = "Copy code"
EDIT = "Edit"


@dataclass
class Rendered:
    html: str
    copies: list[str] = field(default_factory=list)  # the text each copy:N link puts on the clipboard


def code_html(code: str, lang: str, dark: bool) -> str:
    """``code`` highlighted (inline styles: Qt's rich text has no style sheets for classes)."""
    try:
        lexer = get_lexer_by_name(lang) if lang else guess_lexer(code)
    except ClassNotFound:
        lexer = TextLexer()
    formatter = HtmlFormatter(noclasses=True, nowrap=True, style="monokai" if dark else "friendly")
    inner = highlight(code, lexer, formatter)
    background = "#272822" if dark else "#f4f6f8"
    return (
        f'<table width="100%" cellpadding="6" style="background-color:{background}; margin:4px 0">'
        f'<tr><td><pre style="margin:0">{inner}</pre></td></tr></table>'
    )


def markdown_html(text: str) -> str:
    """Markdown as an HTML fragment, by Qt's own Markdown reader (what setMarkdown showed)."""
    if not text.strip():
        return ""
    doc = QTextDocument()
    doc.setMarkdown(text)
    found = _BODY.search(doc.toHtml())
    return found.group(1) if found else html.escape(text)


def _link(href: str, words: str, dark: bool) -> str:
    colour = "#8ab4f8" if dark else "#1a5fb4"
    return f'<a href="{href}" style="color:{colour}; text-decoration:none">{words}</a>'


def continuation_html(prompt: str, continuation: str, dark: bool) -> str:
    """A base model's text continuation: the user's text as it is, then the model's continuation
    of it marked (a tinted background), as one text."""
    tint = "#2d4a3e" if dark else "#e3f4e8"

    def plain(text: str) -> str:
        return html.escape(text).replace("\n", "<br/>")

    return (
        f'<p style="margin:4px 0">{plain(prompt)}'
        f'<span style="background-color:{tint}">{plain(continuation)}</span></p>'
    )


def render_block(block: Block, dark: bool, copies: list[str]) -> str:
    """One message: its Markdown with highlighted code blocks, each with a copy link, then the
    message's own copy link; appends the copied texts to ``copies``. A base model's continuation
    shows as one text, the continuation marked."""
    parts: list[str] = []
    if block.continued is not None:
        parts.append(markdown_html(block.markdown))
        parts.append(continuation_html(*block.continued, dark))
        parts.append(markdown_html(block.footer))
        return "".join(parts) + _links(block, dark, copies)
    at = 0
    for match in FENCE.finditer(block.markdown):
        parts.append(markdown_html(block.markdown[at : match.start()]))
        code = match.group(2).rstrip("\n")
        copies.append(code)
        parts.append(
            f'<p align="right" style="margin:0">{_link(f"copy:{len(copies) - 1}", COPY_CODE, dark)}</p>'
        )
        parts.append(code_html(code, match.group(1), dark))
        at = match.end()
    parts.append(markdown_html(block.markdown[at:]))
    return "".join(parts) + _thumbnails(block) + _links(block, dark, copies)


#: how tall a message's image is shown in the transcript (pixels)
THUMBNAIL_PX = 120


def _thumbnails(block: Block) -> str:
    """A user message's images, small (the chat window's browser loads ``image:KEY``)."""
    if not block.images:
        return ""
    imgs = " ".join(f'<img src="image:{key}" height="{THUMBNAIL_PX}">' for key in block.images)
    return f'<p style="margin:4px 0">{imgs}</p>'


def _links(block: Block, dark: bool, copies: list[str]) -> str:
    """The message's Copy link (and Edit, for one of the user's)."""
    links = []
    if block.text.strip():
        copies.append(block.text)
        links.append(_link(f"copy:{len(copies) - 1}", COPY, dark))
    if block.edit_id is not None:
        links.append(_link(f"edit:{block.edit_id}", EDIT, dark))
    return f'<p style="margin:0">{" &nbsp; ".join(links)}</p>' if links else ""


def render(blocks: list[Block], dark: bool) -> Rendered:
    """The whole transcript, messages separated by a rule."""
    out = Rendered("")
    out.html = "<hr/>".join(render_block(b, dark, out.copies) for b in blocks)
    return out
