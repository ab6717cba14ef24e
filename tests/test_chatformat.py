"""core/chatformat against the real chat templates llama.cpp ships (tests/data/templates, from the
pinned sdist): a tool history renders in each family's own syntax, a call written in that syntax
parses, the tool grammars accept the family's calls and refuse wrong ones (checked by llama.cpp's
own grammar engine), and a plain chat renders exactly as llama-cpp-python's Jinja2ChatFormatter
rendered it before."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp import llama_chat_format
from timeshare.core.chatformat.families import FAMILIES, detect_family
from timeshare.core.chatformat.grammar import ToolGrammarError, tool_grammar, tool_triggers
from timeshare.core.chatformat.history import nine_char_id, normalise, render
from timeshare.core.chatformat.parse import AnswerParser, ParsedCall, parse_answer
from timeshare.core.chatformat.template import ChatTemplate, TemplateError

TEMPLATES = Path(__file__).parent / "data" / "templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city"}},
                "required": ["city"],
            },
        },
    }
]

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_7f3a9b2c1d",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7f3a9b2c1d", "content": "sunny, 21 C"},
]

# template file, family, the call as that template writes it in the history, and the answer a
# model of the family writes for a call (what the parser must read)
CASES = {
    "qwen2.5": (
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>',
    ),
    "qwen3": (
        "Qwen-Qwen3-0.6B.jinja",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<think>\nThe user wants Lyon.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>',
    ),
    "llama3.1": (
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '{"name": "get_weather", "parameters": {"city": "Lyon"}}',
    ),
    "hermes3": (
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>',
    ),
    "mistral-nemo": (
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "'
        + nine_char_id("call_7f3a9b2c1d")
        + '"}]</s>',
        # the [TOOL_CALLS] control token is not in the answer's text
        '[{"name": "get_weather", "arguments": {"city": "Lyon"}, "id": "Ab3dE6gH9"}]',
    ),
}


def _template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("case", sorted(CASES))
def test_tool_history_renders_in_the_family_syntax(case: str) -> None:
    file, family, written, _ = CASES[case]
    template = _template(file)
    assert template.family.name == family
    assert template.caps.tools and template.caps.tool_calls and template.caps.tool_responses
    prompt = render(template, HISTORY, TOOLS)
    assert written in prompt  # arguments as an object, not a quoted string
    assert "The weather of a city" in prompt  # the tools reached the template
    assert "sunny, 21 C" in prompt  # the tool result
    assert prompt.index("Weather in Paris?") < prompt.index(written) < prompt.index("sunny, 21 C")


def test_mistral_ids_are_nine_alphanumerics_in_call_and_result() -> None:
    template = _template("mistralai-Mistral-Nemo-Instruct-2407.jinja")
    prompt = render(template, HISTORY, TOOLS)
    short = nine_char_id("call_7f3a9b2c1d")
    assert len(short) == 9 and short.isalnum()
    assert f'"id": "{short}"' in prompt and f'"call_id": "{short}"' in prompt
    assert "call_7f3a9b2c1d" not in prompt
    assert nine_char_id("Ab3dE6gH9") == "Ab3dE6gH9"  # already valid: kept


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_in_the_family_format_parses(case: str) -> None:
    file, _, _, answer = CASES[case]
    template = _template(file)
    caps = template.caps
    whole = parse_answer(answer, template.family, tools=True, thinks=caps.thinks)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", {"city": "Lyon"})]
    assert whole.content == ""
    if case == "qwen3":
        assert whole.reasoning == "The user wants Lyon."
    # streamed one character at a time: the same calls, nothing else
    parser = AnswerParser(template.family, tools=True, thinks=caps.thinks)
    events = [e for ch in answer for e in parser.feed(ch)] + parser.finish()
    assert [e.call for e in events if e.kind in ("call", "call_end")] == whole.calls
    assert "".join(e.text for e in events if e.kind == "content") == ""
    if case != "mistral-nemo":  # its ids follow the arguments: whole calls only
        # the arguments streamed as written, in pieces, and they add up to the call's
        pieces = [e.text for e in events if e.kind == "call_arguments"]
        assert len(pieces) > 3 and "".join(pieces) == whole.calls[0].arguments
        assert next(e.kind for e in events if e.kind.startswith("call")) == "call_start"


def test_content_before_hermes_calls_and_parallel_calls() -> None:
    text = (
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
    )
    answer = parse_answer(text, FAMILIES["hermes"], tools=True)
    assert answer.content == "Let me check both."
    assert [json.loads(c.arguments)["city"] for c in answer.calls] == ["Paris", "Rome"]


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", "I cannot <tool_call> {broken"),
        ("generic", '{"not": "a call"'),
        ("llama3", 'Here: {"name": "get_weather"}'),
        ("mistral", "[1, 2"),
    ],
)
def test_what_is_not_a_call_stays_content(family: str, text: str) -> None:
    answer = parse_answer(text, FAMILIES[family], tools=True)
    assert answer.calls == []
    assert answer.content == text


def test_without_tools_nothing_is_parsed_as_a_call() -> None:
    text = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    assert parse_answer(text, FAMILIES["hermes"], tools=False).content == text


def test_reasoning_is_split_from_content() -> None:
    qwen3 = _template("Qwen-Qwen3-0.6B.jinja").caps
    assert qwen3.thinks and not qwen3.starts_thinking
    answer = parse_answer(
        "<think>\nPlan it.\n</think>\n\nHello!", FAMILIES["hermes"], tools=False, thinks=True
    )
    assert (answer.reasoning, answer.content) == ("Plan it.", "Hello!")
    # cut off while thinking: all of it is reasoning
    answer = parse_answer("<think>\nStill", FAMILIES["hermes"], tools=False, thinks=True)
    assert (answer.reasoning, answer.content) == ("Still", "")
    # a prompt that opened the block itself (DeepSeek-R1's newer templates): only </think> comes
    answer = parse_answer(
        "Plan.\n</think>\nHi", FAMILIES["generic"], tools=False, thinks=True, starts_thinking=True
    )
    assert (answer.reasoning, answer.content) == ("Plan.", "Hi")
    assert _template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").caps.thinks
    # no <think> first: all content
    answer = parse_answer("Hello <think> there", FAMILIES["hermes"], tools=False, thinks=True)
    assert (answer.reasoning, answer.content) == (None, "Hello <think> there")


def test_generic_template_gets_tool_history_as_text(smollm2_path: Path) -> None:
    llm = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)
    source = llm.metadata["tokenizer.chat_template"]
    template = ChatTemplate(source, bos_token="", eos_token="<|im_end|>")
    assert detect_family(source).name == "generic"
    caps = template.caps
    assert not caps.tools and not caps.tool_calls  # plain ChatML: no tool syntax
    messages = normalise(HISTORY, caps)
    assert messages[2] == {
        "role": "assistant",
        "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    }
    prompt = render(template, HISTORY, TOOLS)
    assert (
        '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>' in prompt
    )
    assert "sunny, 21 C" in prompt


@pytest.mark.parametrize(
    "file",
    [
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "Qwen-Qwen3-0.6B.jinja",
    ],
)
def test_plain_chat_renders_as_llama_cpp_python_did(file: str) -> None:
    source = (TEMPLATES / file).read_text()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And now?"},
    ]
    if "Mistral" in file:
        messages = messages[1:]
    oracle = llama_chat_format.Jinja2ChatFormatter(template=source, eos_token="</s>", bos_token="<s>")
    ours = render(ChatTemplate(source, bos_token="<s>", eos_token="</s>"), messages)
    assert ours == oracle(messages=messages).prompt  # type: ignore[arg-type]


def test_template_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="not valid Jinja"):
        ChatTemplate("{% if %}")
    mistral = _template("mistralai-Mistral-Nemo-Instruct-2407.jinja")
    with pytest.raises(TemplateError, match="alternate"):
        render(mistral, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ---- grammars, checked by llama.cpp's grammar engine ----------------------------------------

FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
    {"name": "now"},  # no parameters: {}
]


@pytest.fixture(scope="module")
def vocab_llm(smollm2_path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)


def _accepts(llm: llama_cpp.Llama, grammar: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets ``text`` through, token by token (each token is
    offered alone: a rejected one gets -inf; only allowed tokens are accepted)."""
    sampler = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, grammar.encode(), b"root")
    assert sampler, "llama.cpp could not parse the grammar"
    try:
        for token in llm.tokenize(text.encode(), add_bos=False, special=True):
            data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
            candidates = llama_cpp.llama_token_data_array(data, 1, -1, False)
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
            if data[0].logit == float("-inf"):
                return False
            llama_cpp.llama_sampler_accept(sampler, token)
        return True
    finally:
        llama_cpp.llama_sampler_free(sampler)


GRAMMAR_CASES = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        ['<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>', "Sure!"],
    ),
    "llama3": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [
            '{"name": "get_weather", "parameters": {"town": "Paris"}}',
            '{"name": "get_weather", "parameters": {}}',
        ],
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "now", "arguments": {}, "id": "abcDEF123"}]',
        ['[TOOL_CALLS][{"name": "now", "arguments": {}, "id": "abc"}]'],
    ),
    "generic": (
        '{"name": "now", "arguments": {}}',
        ['{"name": "now", "arguments": {"x": 1}}', '{"name": "get_weather", "arguments": {"city": 3}}'],
    ),
}


@pytest.mark.parametrize("family", sorted(GRAMMAR_CASES))
def test_tool_grammar_forces_the_family_syntax_and_the_schema(
    vocab_llm: llama_cpp.Llama, family: str
) -> None:
    good, bad = GRAMMAR_CASES[family]
    grammar = tool_grammar(FAMILIES[family], FUNCTIONS, parallel=False)
    assert _accepts(vocab_llm, grammar, good)
    for text in bad:
        assert not _accepts(vocab_llm, grammar, text), text
    # what the grammar lets through, the parser reads back
    parsed = parse_answer(good.replace("[TOOL_CALLS]", ""), FAMILIES[family], tools=True)
    assert parsed.calls and parsed.calls[0].name in ("get_weather", "now")


def test_parallel_and_thinking_grammars(vocab_llm: llama_cpp.Llama) -> None:
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    hermes = FAMILIES["hermes"]
    assert _accepts(vocab_llm, tool_grammar(hermes, FUNCTIONS, parallel=True), f"{call}\n{call}")
    assert not _accepts(vocab_llm, tool_grammar(hermes, FUNCTIONS, parallel=False), f"{call}\n{call}")
    thinking = tool_grammar(hermes, FUNCTIONS, parallel=False, thinks=True)
    assert _accepts(vocab_llm, thinking, f"<think>\nUse now, a<b.\n</think>\n\n{call}")
    assert _accepts(vocab_llm, thinking, call)
    opened = tool_grammar(hermes, FUNCTIONS, parallel=False, starts_thinking=True)
    assert _accepts(vocab_llm, opened, f"Use now.\n</think>\n{call}")
    # lazy grammars start at the marker: no think block in them
    assert not _accepts(
        vocab_llm, tool_grammar(hermes, FUNCTIONS, parallel=False, lazy=True, thinks=True), "<think>"
    )


def test_trigger_patterns_match_where_the_call_starts() -> None:
    import re

    def start(family: str, text: str, thinks: bool = False) -> int | None:
        for pattern in tool_triggers(FAMILIES[family], thinks=thinks):
            m = re.fullmatch(pattern, text)
            if m:
                return m.start(1)
        return None

    assert start("hermes", "Checking. <tool_call>\n{") == len("Checking. ")
    assert start("hermes", "No call here") is None
    assert start("hermes", "<think>maybe <tool_call> later</think>\n<tool_call>", thinks=True) == len(
        "<think>maybe <tool_call> later</think>\n"
    )
    assert start("mistral", "[TOOL_CALLS][{") == 0
    assert start("llama3", '<|python_tag|>{"name": "x"') == len("<|python_tag|>")
    assert start("generic", '  {"name": "x"') == 2
    assert start("generic", 'Text then {"name": "x"') is None


def test_schema_the_converter_cannot_take_is_refused_by_name() -> None:
    bad = [{"name": "fetch", "parameters": {"$ref": "https://example.com/schema.json"}}]
    with pytest.raises(ToolGrammarError, match="fetch"):
        tool_grammar(FAMILIES["hermes"], bad, parallel=False)


def test_parsed_call_keeps_the_model_id() -> None:
    text = '[{"name": "now", "arguments": {}, "id": "Ab3dE6gH9"}]'
    assert parse_answer(text, FAMILIES["mistral"], tools=True).calls == [ParsedCall("now", "{}", "Ab3dE6gH9")]


# ---- lazy grammars through llama.cpp's own lazy sampler (a child process: llama.cpp aborts the
# process when a trigger hands the grammar text it refuses, and that must fail this test, not end
# the test run) ----------------------------------------------------------------------------------

_LAZY_CHILD = r"""
import ctypes, json, sys
import llama_cpp
from timeshare.core.chatformat.families import FAMILIES
from timeshare.core.chatformat.grammar import tool_grammar, tool_triggers

path, cases = sys.argv[1], json.loads(sys.argv[2])
llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
functions = json.loads(sys.argv[3])
out = []
for family, text in cases:
    fam = FAMILIES[family]
    grammar = tool_grammar(fam, functions, parallel=False, lazy=True).encode()
    pats = [p.encode() for p in tool_triggers(fam)]
    arr = (ctypes.c_char_p * len(pats))(*pats)
    none = (llama_cpp.llama_token * 1)()
    vocab = llm._model.vocab
    s = llama_cpp.llama_sampler_init_grammar_lazy_patterns(vocab, grammar, b"root", arr, len(pats), none, 0)
    ok = True
    for t in llm.tokenize(text.encode(), add_bos=False, special=True):
        data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(t, 0.0, 0.0))
        cur = llama_cpp.llama_token_data_array(data, 1, -1, False)
        llama_cpp.llama_sampler_apply(s, ctypes.byref(cur))
        if data[0].logit == float("-inf"):
            ok = False
            break
        llama_cpp.llama_sampler_accept(s, t)
    llama_cpp.llama_sampler_free(s)
    out.append(ok)
print(json.dumps(out))
"""


def test_lazy_grammars_start_at_the_marker_in_llama_cpp(smollm2_path: Path) -> None:
    import subprocess
    import sys

    good = {
        "hermes": "Let me look. "
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "mistral": '[TOOL_CALLS][{"name": "now", "arguments": {}, "id": "abcDEF123"}]',
        "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "generic": '{"name": "now", "arguments": {}}',
    }
    bad = {
        "hermes": 'Let me look. <tool_call>\n{"name": "get_wether"',
        "mistral": '[TOOL_CALLS][{"name": "now", "arguments": {"x": 1}',
        "llama3": '{"name": "get_weather", "parameters": {"town"',
        "generic": '{"name": "nope"',
    }
    text = {"generic": "A plain answer, {not a call}.", "hermes": "No call: <tool_ plain text."}
    cases = [*good.items(), *bad.items(), *text.items()]
    child = subprocess.run(
        [sys.executable, "-c", _LAZY_CHILD, str(smollm2_path), json.dumps(cases), json.dumps(FUNCTIONS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    n = len(good)
    assert results[:n] == [True] * n  # calls after their marker pass
    assert results[n : 2 * n] == [False] * n  # a wrong name or argument after the marker is refused
    assert results[2 * n :] == [True] * len(text)  # text without a marker is left alone
