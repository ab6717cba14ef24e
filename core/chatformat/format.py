"""A model's chat format as the API needs it (the tool-call family, whether it thinks), derived
in one place from its chat template: by the worker from the template it renders with (reported in
``Ready``: ``ModelInfo.chat_family``, ``thinks``, ``starts_thinking``), and by the API from the
GGUF's header only for a model whose worker has not reported yet (not loaded since it started)."""

from __future__ import annotations

from dataclasses import dataclass

from .families import FAMILIES, Family, FamilyName, detect_family
from .template import ChatTemplate, TemplateError


@dataclass(frozen=True)
class ChatFormat:
    """What the API needs to know of a model's chat template."""

    family: Family
    thinks: bool  # the model writes <think>...</think> first
    starts_thinking: bool  # the prompt opens the block itself
    template: bool  # False: the fallback format (no template)


#: the fallback format (no template: family ``generic``, no thinking)
FALLBACK = ChatFormat(detect_family(None), False, False, False)


def of_template(template: ChatTemplate | None) -> ChatFormat:
    """The format of chats rendered with ``template`` (None: the fallback format)."""
    if template is None:
        return FALLBACK
    caps = template.caps
    return ChatFormat(template.family, caps.thinks, caps.starts_thinking, True)


def of_source(source: str | None) -> ChatFormat:
    """The format of a template's text (None or empty: the fallback format; a template that does
    not compile: its worker refuses the model, meanwhile family ``generic``)."""
    if not source:
        return FALLBACK
    try:
        return of_template(ChatTemplate(source))
    except TemplateError:
        return ChatFormat(detect_family(None), False, False, True)


def reported(chat_format: str, family: str, thinks: bool, starts_thinking: bool) -> ChatFormat:
    """The format a worker reported (``ModelInfo``): ``chat_format`` "template" | "fallback"."""
    if chat_format != "template":
        return FALLBACK
    name: FamilyName = family if family in FAMILIES else "generic"
    return ChatFormat(FAMILIES[name], thinks, starts_thinking, True)
