"""Prompt building: a request's messages (chat template or fallback format) or completion prompt
as the model's tokens, tokenized in pieces that can be cancelled.

Chat formats: the GGUF's Jinja chat template (``chat_format == "template"``), or for models without
one (e.g. the Gemma-3-270M base model) the fallback format below (``"fallback"``):

    <system text>\\n\\n            (only when there is a system message)
    User: <text>\\n
    Assistant: <text>\\n
    ...
    User: <last text>\\n
    Assistant:

with stop strings ``"\\nUser:"``, ``"\\nAssistant:"`` and ``"\\n\\n\\n"``, so a base model's answer ends
where it would start the next turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp

from ..chatformat.history import normalise, render
from ..chatformat.template import ChatTemplate, TemplateCaps, TemplateError
from ..config.schema import ModelConfig
from ..errors import ChatTemplateError, InvalidInputError, PromptTooLongError
from ..wire.protocol import ChatMessage, Generate, ImagePart
from .vision import ImageSpan, Vision, close_spans

#: a prompt's images: where each lies in its token list (by start), for the decoder
Media = dict[int, ImageSpan]

FALLBACK_STOP = ("\nUser:", "\nAssistant:", "\n\n\n")

#: Prompts are tokenized in pieces: llama.cpp's special-token split rescans the text after each
#: special token it finds, so one call is quadratic in their number (20k chat messages took 40 s),
#: and one call cannot be cancelled. A piece ends where a special token of the chat template starts
#: (llama.cpp cuts there too, so the tokens are the same) once it holds this many bytes or markers.
_PIECE_BYTES = 4096
_PIECE_MARKERS = 32
#: special-token-like strings in a chat template: <|im_start|>, <start_of_turn>, [INST] ...
_MARKER_CANDIDATE = re.compile(r"<\|[^|<>\s]{1,64}\|>|<[^<>\s{}%|]{1,64}>|\[/?[A-Z_]{2,32}\]")
_SPECIAL_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
#: a piece longer than this many characters per context token is probed first: when its start
#: alone holds more tokens than the context, the prompt is refused without tokenizing it all
_PROBE_CHARS_PER_TOKEN = 8


class Prompts:
    """Builds a loaded model's prompts: ``chat_prompt`` and ``completion_tokens``. Not
    thread-safe: the worker's loop thread is the only caller."""

    def __init__(
        self,
        llm: Any,
        model: ModelConfig,
        template: ChatTemplate | None,
        n_ctx: int,
        vision: Vision | None = None,
    ) -> None:
        self.llm = llm
        self.model = model
        self.template = template  # the chat template, or None for the fallback format
        self.n_ctx = n_ctx  # per sequence
        self.vision = vision  # the model's projector (None: it reads text only)
        self._markers = self._template_markers(template.source if template is not None else "")

    def _template_markers(self, template: str) -> re.Pattern[str] | None:
        """The special tokens a chat template writes (found in its text, checked against the
        vocabulary), as one pattern: where a prompt may be cut into pieces (see _PIECE_BYTES)."""
        llm = self.llm
        vocab = llm._model.vocab
        found: set[str] = set()
        for candidate in set(_MARKER_CANDIDATE.findall(template)):
            ids = llm.tokenize(candidate.encode("utf-8"), add_bos=False, special=True)
            if len(ids) == 1 and llama_cpp.llama_vocab_get_attr(vocab, ids[0]) & _SPECIAL_ATTRS:
                found.add(candidate)
        if not found:
            return None
        return re.compile("|".join(re.escape(m) for m in sorted(found, key=len, reverse=True)))

    def pieces(self, text: str, special: bool) -> list[str]:
        """``text`` cut before special tokens of the template, in pieces of about _PIECE_BYTES."""
        if self._markers is None or not special or len(text) <= _PIECE_BYTES:
            return [text]
        pieces: list[str] = []
        start = 0
        markers = 0
        for match in self._markers.finditer(text):
            cut = match.start()
            markers += 1
            if cut > start and (cut - start >= _PIECE_BYTES or markers > _PIECE_MARKERS):
                pieces.append(text[start:cut])
                start = cut
                markers = 1
        pieces.append(text[start:])
        return pieces

    def tokenize(
        self, text: str, *, add_bos: bool, special: bool, poll: Callable[[], None] = lambda: None
    ) -> list[int]:
        """``llm.tokenize(text)`` in pieces, linear in the text, with ``poll`` (which may raise
        CancelledError) between pieces; raises PromptTooLongError as soon as the tokens so far
        (or the start of a long piece) fill the context, without tokenizing the rest."""
        llm = self.llm
        n_ctx = self.n_ctx
        if llm._model.add_eos_token():  # EOS would end every piece: one call then
            return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))
        tokens: list[int] = []
        pieces = self.pieces(text, special)
        for i, piece in enumerate(pieces):
            poll()
            first = add_bos and i == 0
            probe_chars = _PROBE_CHARS_PER_TOKEN * n_ctx + _PIECE_BYTES
            if len(piece) > probe_chars:
                probe = llm.tokenize(piece[:probe_chars].encode("utf-8"), add_bos=first, special=special)
                if len(tokens) + len(probe) > n_ctx + 8:  # a cut word adds a token or two, no more
                    raise self.too_long(len(tokens) + len(probe) - 8, at_least=True)
                poll()
            tokens += llm.tokenize(piece.encode("utf-8"), add_bos=first, special=special)
            if len(tokens) >= n_ctx:
                raise self.too_long(len(tokens), at_least=i + 1 < len(pieces))
        return tokens

    def _vision(self) -> Vision:
        if self.vision is None:
            raise InvalidInputError(
                f"{self.model.display_name} does not read images: it has no vision projector "
                "(models[].mmproj); send text only, or use a vision model"
            )
        return self.vision

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]] = (),
        poll: Callable[[], None] = lambda: None,
    ) -> tuple[list[int], list[str], Media]:
        """Tokens, extra stop strings and images (by start) for a chat request (``tools``: OpenAI
        tool objects). A message's images go where its ``images[].at`` say, as the projector's
        marker in the text the template renders (llama-server's way)."""
        images = [i.data for m in messages for i in m.images]
        marker = self._vision().marker if images else ""
        history = [chat_message_dict(m, marker) for m in messages]
        if self.template is not None:
            try:
                prompt = render(self.template, history, tools)
            except TemplateError as exc:
                raise ChatTemplateError(
                    f"the chat template of {self.model.display_name} refused these messages: {exc}"
                ) from None
            # the template writes BOS itself (as llama-cpp-python's formatter: added_special)
            if images:
                tokens, media = self._with_images(prompt, images, add_special=False, special=True)
                return tokens, [self.template.eos_token], media
            tokens = self.tokenize(prompt, add_bos=False, special=True, poll=poll)
            return tokens, [self.template.eos_token], {}
        # the fallback format shows only user and assistant turns: tool calls and results as text
        plain = [ChatMessage(role=m["role"], content=m["content"]) for m in normalise(history, _NO_TOOLS)]
        text = fallback_prompt(plain)
        if images:
            tokens, media = self._with_images(text, images, add_special=True, special=False)
            return tokens, list(FALLBACK_STOP), media
        return self.tokenize(text, add_bos=True, special=False, poll=poll), list(FALLBACK_STOP), {}

    def _with_images(
        self, text: str, images: Sequence[bytes], *, add_special: bool, special: bool
    ) -> tuple[list[int], Media]:
        """A prompt with images as tokens (libmtmd's tokenizer: the text between the images as
        the model's tokenizer makes it, the projector's own tokens around each image)."""
        vision = self._vision()
        if text.count(vision.marker) != len(images):
            raise ChatTemplateError(
                f"the chat template of {self.model.display_name} did not show every image of these "
                "messages (an image in a message it leaves out?)"
            )
        tokens, media = vision.tokenize(text, images, add_special=add_special, parse_special=special)
        if len(tokens) >= self.n_ctx:
            close_spans(media)
            raise self.too_long(len(tokens))
        return tokens, media

    def completion_prompt(
        self, prompt: str, images: Sequence[ImagePart], poll: Callable[[], None] = lambda: None
    ) -> tuple[list[int], Media]:
        """``completion_tokens`` of a prompt with images (where ``images[].at`` put them), and
        the images by start."""
        if not images:
            return self.completion_tokens(prompt, poll), {}
        head, tail = self._ends()
        text = with_markers(prompt, images, self._vision().marker)
        body, media = self._with_images(text, [i.data for i in images], add_special=False, special=True)
        return [*head, *body, *tail], {start + len(head): _moved(s, len(head)) for start, s in media.items()}

    def _ends(self) -> tuple[list[int], list[int]]:
        """The tokens create_completion puts before and after a string prompt."""
        llm = self.llm
        vocab = llm._model
        bos, cls_id, sep = int(llm.token_bos()), int(vocab.token_cls()), int(vocab.token_sep())
        head = [cls_id if cls_id != -1 else bos]
        if not vocab.add_bos_token() or head == [-1]:
            head = []
        tail = [sep if sep != -1 else int(llm.token_eos())]
        if not vocab.add_eos_token() and sep == -1:
            tail = []
        return head, tail

    def completion_tokens(self, prompt: str, poll: Callable[[], None] = lambda: None) -> list[int]:
        """A completion prompt's tokens, built as ``Llama.create_completion`` builds them for a
        string prompt (BOS or CLS when the vocabulary adds one, EOS or SEP when it adds one)."""
        head, tail = self._ends()
        body = self.tokenize(prompt, add_bos=False, special=True, poll=poll) if prompt else []
        return [*head, *(int(t) for t in body), *tail]

    def too_long(self, n: int, *, at_least: bool = False) -> PromptTooLongError:
        size = f"at least {n}" if at_least else f"{n}"
        return PromptTooLongError(
            f"the prompt is {size} tokens but {self.model.display_name} holds {self.n_ctx} tokens "
            f"of context (the answer needs room too): shorten the prompt or raise n_ctx for this model"
        )


#: what the fallback format can show of tools: nothing (calls and results become text)
_NO_TOOLS = TemplateCaps(
    tools=False,
    tool_calls=False,
    tool_responses=False,
    object_arguments=True,
    parallel_calls=True,
    nine_char_ids=False,
    thinks=False,
    starts_thinking=False,
)


def with_markers(text: str, images: Sequence[ImagePart], marker: str) -> str:
    """``text`` with ``marker`` before character ``at`` of each image (the images in order)."""
    out: list[str] = []
    last = 0
    for image in images:
        out.append(text[last : image.at])
        out.append(marker)
        last = image.at
    out.append(text[last:])
    return "".join(out)


def _moved(span: ImageSpan, by: int) -> ImageSpan:
    span.start += by
    return span


def chat_message_dict(m: ChatMessage, marker: str = "") -> dict[str, Any]:
    """A protocol chat message as the OpenAI-shaped dict core/chatformat takes (its images as
    ``marker`` in its text)."""
    content = with_markers(m.content, m.images, marker) if m.images else m.content
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def tools_of(req: Generate) -> list[dict[str, Any]]:
    """A request's tools as the OpenAI tool objects templates take."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in req.tools
    ]


def fallback_prompt(messages: Sequence[ChatMessage]) -> str:
    """The plain chat format for models without a chat template (see the module docstring)."""
    parts: list[str] = []
    system = [m.content for m in messages if m.role == "system"]
    if system:
        parts.append("\n".join(system).strip() + "\n\n")
    for m in messages:
        if m.role == "user":
            parts.append(f"User: {m.content.strip()}\n")
        elif m.role == "assistant":
            parts.append(f"Assistant: {m.content.strip()}\n")
    parts.append("Assistant:")
    return "".join(parts)
