"""The tools path of /v1/chat/completions: the request fields (tools, tool_choice,
parallel_tool_calls, legacy functions), the plan per model format, and the answer's shape, whole and
streamed (assembled by the official openai client's own stream accumulator)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _api_util import SMOL, Served, serving
from openai.lib.streaming.chat import ChatCompletionStreamState
from timeshare.core.api.chat_output import ChatOutput
from timeshare.core.api.errors import BadRequestError
from timeshare.core.api.tools import (
    ChatFormat,
    ToolRequest,
    chat_format_of,
    parse_tool_request,
    plan,
    prepare,
)
from timeshare.core.chatformat.families import FAMILIES
from timeshare.core.config.schema import ModelConfig
from timeshare.core.wire.protocol import ChatMessage, ToolSpec

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _fmt(family: str, thinks: bool = False) -> ChatFormat:
    return ChatFormat(FAMILIES[family], thinks, False, True)  # type: ignore[index]


# ---- request fields ----------------------------------------------------------------------------


def test_tool_fields_parse() -> None:
    req = parse_tool_request({"tools": [WEATHER]})
    assert req == ToolRequest((WEATHER,), "auto", None, False, False)  # llama-server's default
    req = parse_tool_request({"tools": [WEATHER], "parallel_tool_calls": True})
    assert req is not None and req.parallel
    named = parse_tool_request(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert named is not None and (named.choice, named.named, named.parallel) == (
        "required",
        "get_weather",
        False,
    )
    req = parse_tool_request({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert req is not None and (req.choice, req.parallel) == ("required", False)
    assert parse_tool_request({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tool_request({"tools": []}) is None
    assert parse_tool_request({}) is None
    legacy = parse_tool_request(
        {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    )
    assert legacy is not None and legacy.legacy and legacy.named == "get_weather"
    assert legacy.tools == (WEATHER,)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only tools of type 'function'"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not in",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tool_choice": "required"}, "tool_choice", "empty"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions", "not both"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        ({"tools": [WEATHER], "function_call": "auto"}, "function_call", "tool_choice"),
        ({"tools": {"a": 1}}, "tools", "list"),
    ],
)
def test_bad_tool_fields_are_refused_by_name(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_tool_request(body)
    assert info.value.param == param
    assert words in info.value.message


def test_a_schema_the_converter_cannot_take_is_a_400_naming_tools() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://x.test/s.json"}}}
    req = parse_tool_request({"tools": [bad], "tool_choice": "required"})
    with pytest.raises(BadRequestError) as info:
        plan(req, _fmt("hermes"))
    assert info.value.param == "tools" and "'f'" not in info.value.message and "f" in info.value.message


# ---- plans -------------------------------------------------------------------------------------


def test_plans_per_family() -> None:
    auto = parse_tool_request({"tools": [WEATHER]})
    required = parse_tool_request({"tools": [WEATHER], "tool_choice": "required"})
    hermes = plan(auto, _fmt("hermes"))
    assert hermes.template_tools == (WEATHER,) and not hermes.system_prompt
    assert hermes.grammar is not None and hermes.grammar_triggers  # lazy
    forced = plan(required, _fmt("hermes", thinks=True))
    assert forced.grammar is not None and not forced.grammar_triggers and "<think>" in forced.grammar
    generic = plan(required, _fmt("generic"))
    assert generic.template_tools == ()  # the template cannot show them: the system prompt does
    assert "get_weather" in generic.system_prompt and "only the JSON object" in generic.system_prompt
    messages = generic.messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert messages[0]["content"].startswith("Be brief.\n\n") and "get_weather" in messages[0]["content"]
    assert plan(None, _fmt("hermes")).grammar is None


def test_chat_format_of_the_demo_models(smollm2_path: Path, tmp_path: Path) -> None:
    smol = ModelConfig(id="smol", path=str(smollm2_path))
    fmt = chat_format_of(smol)
    assert (fmt.family.name, fmt.thinks, fmt.template) == ("generic", False, True)
    qwen3 = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    fmt = chat_format_of(ModelConfig(id="q", path=str(smollm2_path), chat_template=qwen3))
    assert (fmt.family.name, fmt.thinks) == ("hermes", True)
    fmt = chat_format_of(ModelConfig(id="f", path=str(smollm2_path), chat_format="fallback"))
    assert (fmt.family.name, fmt.template) == ("generic", False)


def test_prepare_gives_the_worker_messages_and_tool_specs(smollm2_path: Path) -> None:
    qwen = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    messages = (ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi"))
    request = parse_tool_request({"tools": [WEATHER], "tool_choice": "required"})
    hermes = prepare(messages, request, ModelConfig(id="q", path=str(smollm2_path), chat_template=qwen))
    assert hermes.messages == messages  # the template shows the tools itself
    assert hermes.tools == (
        ToolSpec("get_weather", "The weather of a city", WEATHER["function"]["parameters"]),
    )
    generic = prepare(messages, request, ModelConfig(id="s", path=str(smollm2_path)))
    assert generic.tools == ()
    assert generic.messages[0].content.startswith("Be brief.\n\nYou can call these functions")
    assert generic.messages[1:] == messages[1:]
    plain = prepare(messages, None, ModelConfig(id="s", path=str(smollm2_path)))
    assert (plain.messages, plain.tools, plain.plan.grammar) == (messages, (), None)


# ---- answers -----------------------------------------------------------------------------------


def _chunks(output: ChatOutput, pieces: list[str], finish: str) -> list[dict[str, Any]]:
    deltas = [{"role": "assistant", "content": ""}]
    for piece in pieces:
        deltas += output.feed(piece)
    deltas += output.finish()
    chunks = [
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": None}],
        }
        for d in deltas
    ]
    chunks.append(
        {**chunks[0], "choices": [{"index": 0, "delta": {}, "finish_reason": output.finish_reason(finish)}]}
    )
    return chunks


def _assemble(chunks: list[dict[str, Any]]) -> Any:
    from openai.types.chat import ChatCompletionChunk

    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion()


def test_streamed_calls_assemble_in_the_openai_client() -> None:
    req = parse_tool_request({"tools": [WEATHER], "parallel_tool_calls": True})
    answer = (
        "Checking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    pieces = [answer[i : i + 3] for i in range(0, len(answer), 3)]
    output = ChatOutput(plan(req, _fmt("hermes")))
    completion = _assemble(_chunks(output, pieces, "stop"))
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    # the same answer whole: the same message
    whole = ChatOutput(plan(req, _fmt("hermes"))).message(answer)
    assert whole["content"] == "Checking."
    assert [c["function"] for c in whole["tool_calls"]] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in calls
    ]


@pytest.mark.parametrize(
    ("family", "answer"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
        ("generic", '{"name": "get_weather", "arguments": {"city": "Par'),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Par'),
    ],
)
def test_a_call_cut_by_max_tokens_is_a_partial_call_with_finish_reason_length(
    family: str, answer: str
) -> None:
    # issue 38: a forced call cut by max_tokens came back as text; OpenAI returns the partial call
    req = parse_tool_request({"tools": [WEATHER], "tool_choice": "required"})
    pieces = [answer[i : i + 4] for i in range(0, len(answer), 4)]
    output = ChatOutput(plan(req, _fmt(family)))
    with pytest.raises(openai.LengthFinishReasonError) as cut:  # the client's stream state says so
        _assemble(_chunks(output, pieces, "length"))
    choice = cut.value.completion.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content
    calls = choice.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == '{"city": "Par'
    whole = ChatOutput(plan(req, _fmt(family)))
    message = whole.message(answer)
    assert whole.finish_reason("length") == "length"
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Par'}
    ]


def test_reasoning_content_and_legacy_function_call() -> None:
    output = ChatOutput(plan(None, _fmt("hermes", thinks=True)))
    message = output.message("<think>\nWhy not.\n</think>\n\nHello!")
    assert message == {"role": "assistant", "content": "Hello!", "reasoning_content": "Why not."}
    assert output.finish_reason("stop") == "stop"
    legacy = parse_tool_request({"functions": [WEATHER["function"]]})
    output = ChatOutput(plan(legacy, _fmt("generic")))
    message = output.message('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert message["content"] is None and "tool_calls" not in message
    assert message["function_call"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert output.finish_reason("stop") == "function_call"


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    req = parse_tool_request({"tools": [WEATHER]})
    message = ChatOutput(plan(req, _fmt("mistral"))).message(
        '[{"name": "get_weather", "arguments": {"city": "Nice"}, "id": "Ab3dE6gH9"}, '
        '{"name": "get_weather", "arguments": {"city": "Metz"}}]'
    )
    ids = [c["id"] for c in message["tool_calls"]]
    assert ids[0] == "Ab3dE6gH9" and len(ids[1]) == 9 and ids[1].isalnum()


# ---- end to end: timeshare serve with the real demo model, through the official clients ----------

SMOL_QWEN = "smol-qwen-template"  # SmolLM2's GGUF with Qwen2.5's template (hermes family; ChatML tokens)
TEMPLATES = Path(__file__).parent / "data" / "templates"


@pytest.fixture(scope="module")
def tools_served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("tools-home")
    qwen = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    config = home / "timeshare.toml"
    config.write_text(
        "\n".join(
            [
                "[[models]]",
                f'id = "{SMOL}"',
                f'path = "{smollm2_path}"',
                "",
                "[[models]]",
                f'id = "{SMOL_QWEN}"',
                f'path = "{smollm2_path}"',
                f"chat_template = '''{qwen}'''",
                "",
            ]
        )
    )
    with serving(home, config=config) as server:
        server.wait_ready([SMOL, SMOL_QWEN])
        yield server


@pytest.fixture(scope="module")
def tools_client(tools_served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tools_served.url}/v1", api_key="x", max_retries=0, timeout=180) as c:
        yield c


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _validates(arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])  # type: ignore[arg-type]
    return args  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", [SMOL, SMOL_QWEN])
def test_required_returns_a_call_whose_arguments_validate(tools_client: openai.OpenAI, model: str) -> None:
    answer = tools_client.chat.completions.create(
        model=model,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_tokens=200,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].function.name == "get_weather"
    _validates(calls[0].function.arguments)
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("model", [SMOL, SMOL_QWEN])
def test_a_forced_call_cut_by_max_tokens_comes_back_as_a_partial_call(
    tools_client: openai.OpenAI, model: str
) -> None:
    # issue 38: it came back as text; OpenAI returns the partial tool_calls with "length"
    kwargs: Any = {"model": model, "messages": ASK, "tools": [WEATHER], "temperature": 0}
    whole = tools_client.chat.completions.create(tool_choice="required", max_tokens=200, **kwargs)
    assert whole.usage is not None and whole.choices[0].finish_reason == "tool_calls"
    arguments = json.loads(whole.choices[0].message.tool_calls[0].function.arguments)  # type: ignore[index]
    assert arguments  # a city: its quote and value are the last tokens of the arguments
    cut = tools_client.chat.completions.create(
        tool_choice="required", max_tokens=whole.usage.completion_tokens - 4, **kwargs
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "length", choice
    assert not choice.message.content
    calls = choice.message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert calls[0].function.arguments.startswith("{")


def test_streamed_tool_calls_assemble_in_the_client(tools_client: openai.OpenAI) -> None:
    with tools_client.chat.completions.stream(
        model=SMOL_QWEN,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=200,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].id.startswith("call_")
    _validates(calls[0].function.arguments)


def test_a_tool_result_round_trip_continues_the_conversation(tools_client: openai.OpenAI) -> None:
    model = SMOL_QWEN  # a template with tool syntax (the generic one's history: test_chatformat)
    call = {
        "id": "call_0f3c9a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0f3c9a", "content": '{"temperature_c": 21, "sky": "sunny"}'},
    ]
    answer = tools_client.chat.completions.create(
        model=model,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        temperature=0,
        max_tokens=24,
        extra_body={"cache_prompt": False},
    )
    reply = answer.choices[0]  # auto: text, or another call (then a valid one, or one cut short)
    if reply.finish_reason == "tool_calls":
        assert reply.message.tool_calls
        _validates(reply.message.tool_calls[0].function.arguments)
    elif reply.message.tool_calls:
        assert reply.finish_reason == "length"  # a call cut by max_tokens, as far as written
    else:
        assert reply.finish_reason in ("stop", "length") and reply.message.content
    # the call and its result reached the prompt: longer than the question with the same tools
    alone = tools_client.chat.completions.create(
        model=model,
        messages=ASK,
        tool_choice="none",
        tools=[WEATHER],
        max_tokens=1,  # type: ignore[arg-type,list-item]
    )
    assert answer.usage is not None and alone.usage is not None
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 15


def test_http_refusals_name_the_field(tools_served: Served) -> None:
    body = {
        "model": SMOL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    }
    response = httpx.post(f"{tools_served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"


def test_langchain_bind_tools(tools_served: Served) -> None:
    import langchain_openai
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    chat = langchain_openai.ChatOpenAI(
        model=SMOL, base_url=f"{tools_served.url}/v1", api_key="x", temperature=0, max_tokens=200
    )
    message = chat.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"].get("city"), str)


def test_tools_and_another_grammar_are_refused(smollm2_path: Path) -> None:
    import dataclasses

    from timeshare.core.api.chat_output import prepare_chat
    from timeshare.core.api.requests import parse_chat_request

    req = parse_chat_request({"model": SMOL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    model = ModelConfig(id=SMOL, path=str(smollm2_path))
    fields, output = prepare_chat(req, model)
    assert fields["sampling"].grammar and output is not None
    json_only = dataclasses.replace(req, sampling=req.sampling.replace(grammar='root ::= "{}"'))
    with pytest.raises(BadRequestError) as info:
        prepare_chat(json_only, model)
    assert info.value.param == "tools" and "one of them" in info.value.message
    # a plain request keeps its fields as they were, and needs no shaping
    plain = parse_chat_request({"model": SMOL, "messages": ASK})
    fields, output = prepare_chat(plain, model)
    assert output is None and fields["messages"] == plain.messages and fields["tools"] == ()
    assert fields["sampling"] == plain.sampling
