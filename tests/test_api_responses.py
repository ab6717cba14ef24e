"""The Responses API on `timeshare serve`, through the real clients: the official ``openai`` SDK
(``responses.create`` whole and streamed, a function-tool round trip, a ``previous_response_id``
chain, ``responses.parse`` with a pydantic model, retrieve / delete / input_items) and the OpenAI
Agents SDK's default (Responses) model running a tool-calling agent. The oracle for answers is the
same conversation through /v1/chat/completions (greedy, from an empty KV cache); the oracle for a
chain's KV reuse is the same turns through chat completions with the ``conversation`` extension."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _api_util import GEMMA, SMOL, Served, seed_gemma_cache, serving
from pydantic import BaseModel
from timeshare.core.api.response_store import ResponseStore

pytestmark = pytest.mark.slow

KEY = "responses-key"
N = 10  # a short answer keeps the module fast (greedy answers of the demo models are fixed)
THINKS = "smol-thinks"  # SmolLM2 with a template whose prompt opens a <think> block
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _config(home: Path, smollm2_path: Path, gemma3_path: Path | None, api_lines: str = "") -> Path:
    lines = [
        "[api]",
        f'key = "{KEY}"',
        api_lines,
        "",
        "[[models]]",
        f'id = "{SMOL}"',
        f'path = "{smollm2_path}"',
    ]
    if gemma3_path is not None:
        lines += ["", "[[models]]", f'id = "{GEMMA}"', f'path = "{gemma3_path}"']
        lines += ["", "[[models]]", f'id = "{THINKS}"', f'path = "{smollm2_path}"']
        lines += [f"chat_template = '''{THINKING_TEMPLATE}'''"]
    config = home / "elsewhere" / "timeshare.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("\n".join(lines) + "\n")
    return config


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("responses-home")
    seed_gemma_cache(home, gemma3_path)
    with serving(home, config=_config(home, smollm2_path, gemma3_path), key=KEY) as server:
        server.wait_ready([SMOL, GEMMA, THINKS])
        yield server
        assert server.proc.poll() is None, server.log_text()[-3000:]
    assert server.proc.returncode == 0, server.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=180) as c:
        yield c


def _chat(client: openai.OpenAI, messages: list[dict[str, str]], n: int = N, **extra: Any) -> Any:
    """The oracle: the same conversation through /v1/chat/completions, greedy."""
    return client.chat.completions.create(
        model=SMOL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=n,
        temperature=0,
        extra_body=extra or {"cache_prompt": False},
    )


def _evaluated(answer: Any) -> int:
    extras = answer.model_extra["timeshare"]
    assert isinstance(extras, dict)
    return int(extras["prompt_tokens_evaluated"])


# ---- responses.create ----------------------------------------------------------------------------


def test_create_answers_what_chat_completions_answers(client: openai.OpenAI) -> None:
    instructions, question = "You answer in one short sentence.", "Name a colour."
    r = client.responses.create(
        model=SMOL, instructions=instructions, input=question, max_output_tokens=N, temperature=0
    )
    oracle = _chat(
        client, [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == SMOL
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant"  # type: ignore[union-attr]
    assert r.output_text == oracle.choices[0].message.content
    assert r.usage is not None and oracle.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        oracle.usage.prompt_tokens,
        oracle.usage.completion_tokens,
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if oracle.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert (r.instructions, r.max_output_tokens, r.temperature) == (instructions, N, 0.0)
    assert _evaluated(r) > 0


def test_input_items_are_the_conversation_chat_completions_sees(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=SMOL,
        input=[
            {"role": "developer", "content": "You are terse."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Hi! "},
                    {"type": "input_text", "text": "Who are you?"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "A helper.", "annotations": []}],
            },
            {"role": "user", "content": "What can you do?"},
        ],
        max_output_tokens=N,
        temperature=0,
        store=False,
    )
    oracle = _chat(
        client,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi! Who are you?"},
            {"role": "assistant", "content": "A helper."},
            {"role": "user", "content": "What can you do?"},
        ],
    )
    assert r.output_text == oracle.choices[0].message.content
    assert (
        r.usage is not None
        and oracle.usage is not None
        and r.usage.input_tokens == oracle.usage.prompt_tokens
    )


def test_stream_sends_the_responses_event_sequence(client: openai.OpenAI) -> None:
    ask = {
        "model": SMOL,
        "input": "Count to three.",
        "max_output_tokens": N,
        "temperature": 0,
        "store": False,
    }
    whole = client.responses.create(**ask)  # type: ignore[call-overload]
    events = list(client.responses.create(**ask, stream=True))  # type: ignore[call-overload]
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == events[-4].text == events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]


def test_logprobs_come_with_the_output_text(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=SMOL,
        input="Say yes.",
        max_output_tokens=4,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
        store=False,
    )
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and r.usage is not None
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    assert "".join(bytes(e.bytes).decode(errors="replace") for e in part.logprobs) == part.text


# ---- tools ---------------------------------------------------------------------------------------


def test_a_function_tool_round_trip(client: openai.OpenAI) -> None:
    question = "What is the weather in Paris?"
    r = client.responses.create(
        model=SMOL,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,  # type: ignore[list-item]
    )
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[arg-type]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}
    # the result through previous_response_id: the call comes from the store
    follow = client.responses.create(
        model=SMOL,
        previous_response_id=r.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=N,
        temperature=0,  # type: ignore[list-item]
    )
    assert follow.previous_response_id == r.id and follow.output
    # the same round trip stateless: the whole history as items renders the same prompt
    again = client.responses.create(
        model=SMOL,
        input=[{"role": "user", "content": question}, call.model_dump(exclude_none=True), result],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=N,
        temperature=0,
        store=False,
    )
    assert again.usage is not None and follow.usage is not None
    assert again.usage.input_tokens == follow.usage.input_tokens


def test_a_streamed_call_sends_its_arguments_as_deltas(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=SMOL,
            input="Weather in Rome?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            stream=True,
            store=False,
        )
    )
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    final = events[-1]
    assert final.type == "response.completed"
    assert deltas == done.arguments == final.response.output[0].arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(deltas), WEATHER["parameters"])  # type: ignore[arg-type]
    # the SDK's own stream helper assembles the same answer (a completed one: it wants
    # response.completed)
    with client.responses.stream(
        model=SMOL,
        input="Weather in Rome?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        store=False,
    ) as stream:
        helped = stream.get_final_response()
    assert helped.output[0].arguments == deltas  # type: ignore[union-attr]


# ---- structured output ---------------------------------------------------------------------------


class Verdict(BaseModel):
    ok: bool
    score: int


def test_responses_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=SMOL,
        input="Is bread good? Give a verdict.",
        text_format=Verdict,
        temperature=0,
        max_output_tokens=40,
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Verdict)
    assert (
        parsed.text is not None
        and parsed.text.format is not None
        and parsed.text.format.type == "json_schema"
    )
    as_object = client.responses.create(
        model=SMOL,
        input="Describe bread as JSON.",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=40,
        store=False,
    )
    assert as_object.output_text.lstrip().startswith("{")
    if as_object.status == "completed":
        assert isinstance(json.loads(as_object.output_text), dict)


# ---- reasoning -----------------------------------------------------------------------------------


def test_a_thinking_model_answers_with_a_reasoning_item(client: openai.OpenAI) -> None:
    r = client.responses.create(model=THINKS, input="Hi", max_output_tokens=6, temperature=0, store=False)
    assert r.output[0].type == "reasoning"
    assert r.output[0].content and r.output[0].content[0].text  # type: ignore[union-attr]
    events = list(
        client.responses.create(
            model=THINKS, input="Hi", max_output_tokens=6, temperature=0, stream=True, store=False
        )
    )
    assert "response.reasoning_text.delta" in [e.type for e in events]


def test_a_model_stopped_mid_stream_ends_it_with_an_error_and_a_failed_response(
    served: Served, client: openai.OpenAI
) -> None:
    """An answer cut short is never passed off as finished: the stream's last events are an
    ``error`` (the reason) and ``response.failed``."""
    stream = client.responses.create(
        model=THINKS, input="Tell me a long story.", max_output_tokens=2000, temperature=0, stream=True
    )
    events = []
    for event in stream:
        events.append(event)
        if event.type.endswith(".delta") and len(events) == 6:
            stopped = httpx.post(
                f"{served.url}/timeshare/v1/models/{THINKS}/sleep",
                json={"level": "stop"},
                headers=served.headers(),
                timeout=120,
            )
            assert stopped.status_code == 200
    types = [e.type for e in events]
    assert types[-2:] == ["error", "response.failed"], types[-6:]
    assert "stopped" in events[-2].message  # type: ignore[union-attr]
    failed = events[-1].response  # type: ignore[union-attr]
    assert (
        failed.status == "failed" and failed.error is not None and failed.error.message == events[-2].message
    )  # type: ignore[union-attr]
    assert "response.completed" not in types and "response.incomplete" not in types


# ---- previous_response_id ------------------------------------------------------------------------


def test_a_chain_evaluates_only_its_new_input_even_after_a_switch(client: openai.OpenAI) -> None:
    """The follow-ups go to the chain's KV: what they evaluate is what the same turns through
    chat completions with a ``conversation`` evaluate (the new input and the turn's markers), and
    never the earlier turns, also after a GPU switch to another model in between."""
    system = "You are the assistant of a bakery on Mill Street. Answer in one short sentence."
    turns = ["Do you sell rye bread?", "Is it sliced?", "When do you open?"]
    history = [{"role": "system", "content": system}]
    previous: Any = None
    for i, question in enumerate(turns):
        if i == 2:  # another model answers in between: the GPU switches away and back
            client.responses.create(model=GEMMA, input="Hello", max_output_tokens=2, store=False)
        r = client.responses.create(
            model=SMOL,
            instructions=system,
            input=question,
            previous_response_id=previous.id if previous is not None else None,
            max_output_tokens=8,
            temperature=0,
        )
        history.append({"role": "user", "content": question})
        oracle = _chat(client, history, 8, conversation="oracle-chain")
        assert r.usage is not None and oracle.usage is not None
        assert r.usage.input_tokens == oracle.usage.prompt_tokens
        if i == 0:
            assert r.output_text == oracle.choices[0].message.content  # both from an empty KV cache
        else:
            evaluated = _evaluated(r)
            assert evaluated == _evaluated(oracle), (i, r.usage, oracle.usage)
            assert evaluated == r.usage.input_tokens - r.usage.input_tokens_details.cached_tokens
            assert previous.usage is not None
            # nothing of the earlier turns (their prompt and answer) was evaluated again
            assert (
                evaluated
                <= r.usage.input_tokens - previous.usage.input_tokens - previous.usage.output_tokens + 1
            )
            assert r.previous_response_id == previous.id
        if i == 2:
            assert r.model_extra["timeshare"]["switched"]  # type: ignore[index]
        history.append({"role": "assistant", "content": r.output_text})
        previous = r


def test_stored_responses_are_retrieved_listed_and_deleted(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=SMOL,
        input=[{"role": "user", "content": "Hello there."}],
        max_output_tokens=4,
        temperature=0,
        metadata={"purpose": "test"},
    )
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert got.metadata == {"purpose": "test"}
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].id.startswith("msg_")  # type: ignore[union-attr]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as deleted:
        client.responses.create(model=SMOL, input="And?", previous_response_id=r.id, max_output_tokens=2)
    assert deleted.value.param == "previous_response_id" and "not a stored response" in deleted.value.message
    unstored = client.responses.create(model=SMOL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as missing:
        client.responses.create(
            model=SMOL, input="And?", previous_response_id=unstored.id, max_output_tokens=2
        )
    assert missing.value.param == "previous_response_id"


def test_a_response_continued_by_another_model_is_refused(client: openai.OpenAI) -> None:
    r = client.responses.create(model=SMOL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as other:
        client.responses.create(model=GEMMA, input="And?", previous_response_id=r.id, max_output_tokens=2)
    assert other.value.param == "previous_response_id" and SMOL in other.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": "x", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
            "tools[0].type",
        ),
        ({"input": "x", "background": True}, "background"),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "1"}]},
            "input[0].call_id",
        ),
        ({"input": [{"role": "user", "content": "x"}] * 5000}, "input"),
        ({"input": "x", "previous_response_id": "resp_never"}, "previous_response_id"),
        ({"input": "x", "model": "no-such-model"}, "model"),
    ],
)
def test_refusals_over_http_name_the_field_and_lose_nothing(
    served: Served, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{served.url}/v1/responses", json={"model": SMOL, **body}, headers=served.headers(), timeout=60
    )
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    ok = httpx.post(
        f"{served.url}/v1/responses",
        json={"model": SMOL, "input": "Hi", "max_output_tokens": 1, "store": False},
        headers=served.headers(),
        timeout=120,
    )
    assert ok.status_code == 200


def test_a_chain_a_thousand_deep_is_a_clear_400(served: Served, client: openai.OpenAI) -> None:
    """Chains written straight into the server's store (what a thousand turns would leave): one
    1,000 deep is read back whole (no recursion) and refused because it is longer than the
    model's context; one longer than the API's limit is refused naming previous_response_id."""
    store = ResponseStore(served.home / "data" / "responses.sqlite3", keep=10**6)
    store.get("none")  # the schema exists
    db = sqlite3.connect(store.path)
    now = time.time()
    turn = json.dumps(
        [{"role": "user", "content": "Tell me more."}, {"role": "assistant", "content": "Sure."}]
    )
    rows = [
        (
            f"resp_deep{i}",
            SMOL,
            now + i * 1e-4,
            f"resp_deep{i - 1}" if i else None,
            "responses-deep",
            i + 1,
            turn,
            "[]",
            "{}",
        )
        for i in range(5000)
    ]
    with db:
        db.executemany("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.close()
    with pytest.raises(openai.BadRequestError) as long:
        client.responses.create(
            model=SMOL, input="And?", previous_response_id="resp_deep999", max_output_tokens=2
        )
    assert long.value.code == "context_length_exceeded", long.value.message
    with pytest.raises(openai.BadRequestError) as deeper:
        client.responses.create(
            model=SMOL, input="And?", previous_response_id="resp_deep4999", max_output_tokens=2
        )
    assert deeper.value.param == "previous_response_id" and "more than" in deeper.value.message
    assert client.responses.create(model=SMOL, input="Hi", max_output_tokens=1, store=False).output


# ---- the OpenAI Agents SDK -----------------------------------------------------------------------


def test_an_agents_sdk_agent_calls_a_tool_through_its_default_responses_model(served: Served) -> None:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="You tell people the weather. Use the tool.",
        model=SMOL,
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )

    async def runs() -> tuple[Any, Any, list[str]]:
        # one event loop for the client's connections
        async with openai.AsyncOpenAI(
            base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=180
        ) as c:
            set_tracing_disabled(True)
            set_default_openai_api("responses")  # the SDK's default, said out loud
            set_default_openai_client(c, use_for_tracing=False)
            whole = await Runner.run(agent, "What is the weather in Paris?")
            streamed = Runner.run_streamed(agent, "And in Oslo?")
            kinds = [event.type async for event in streamed.stream_events()]
            return whole, streamed, kinds

    whole, streamed, kinds = asyncio.run(runs())
    assert len(calls) == 2
    assert whole.final_output == f"Sunny in {calls[0]}" and streamed.final_output == f"Sunny in {calls[1]}"
    assert "raw_response_event" in kinds


# ---- a restart and the bounds --------------------------------------------------------------------


def test_stored_responses_and_their_kv_survive_a_restart_within_the_bounds(
    tmp_path: Path, smollm2_path: Path
) -> None:
    home = tmp_path / "home"
    config = _config(home, smollm2_path, None, "responses_kept = 4")
    system = "You are the assistant of a bakery on Mill Street. Answer in one short sentence."

    def ask(c: openai.OpenAI, question: str, previous: str | None) -> Any:
        return c.responses.create(
            model=SMOL,
            instructions=system,
            input=question,
            previous_response_id=previous,
            max_output_tokens=8,
            temperature=0,
        )

    with serving(home, config=config, key=KEY) as server:
        server.wait_ready([SMOL])
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=180) as c:
            r1 = ask(c, "Do you sell rye bread?", None)
            r2 = ask(c, "Is it sliced?", r1.id)
    with serving(home, config=config, key=KEY) as server:
        server.wait_ready([SMOL])
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=180) as c:
            assert c.responses.retrieve(r2.id).model_dump() == r2.model_dump()
            r3 = ask(c, "When do you open?", r2.id)
            assert r3.usage is not None and r2.usage is not None
            # the chain's KV came back from the KV folder: only the new turn was evaluated
            assert (
                0
                < _evaluated(r3)
                <= r3.usage.input_tokens - r2.usage.input_tokens - r2.usage.output_tokens + 1
            )
            for k in range(2):  # responses_kept = 4: r1 goes
                ask(c, f"Unrelated question {k}?", None)
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(r1.id)
            with pytest.raises(openai.BadRequestError) as broken:
                ask(c, "And on Sunday?", r3.id)
            assert broken.value.param == "previous_response_id" and r1.id in broken.value.message


def test_a_chains_kv_files_go_with_its_last_stored_response(tmp_path: Path, smollm2_path: Path) -> None:
    """A chain's KV conversation is kept in the KV folder while any of its responses is stored:
    deleting its last one (DELETE /v1/responses/{id}) removes its files, and a response that
    went while the server was down (here: deleted from the file) has its files swept at the
    next start. Another chain's file stays throughout."""
    from timeshare.core.kv_folder import kv_file

    home = tmp_path / "home"
    config = _config(home, smollm2_path, None)
    kv_dir = home / "data" / "kv" / SMOL

    def ask(c: openai.OpenAI, question: str, previous: str | None) -> Any:
        return c.responses.create(
            model=SMOL, input=question, previous_response_id=previous, max_output_tokens=4, temperature=0
        )

    def chain_file(first: Any) -> Path:
        return kv_file(kv_dir, SMOL, f"responses-{first.id}")

    def client(server: Served) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=180)

    with serving(home, config=config, key=KEY) as server:
        server.wait_ready([SMOL])
        with client(server) as c:
            a1 = ask(c, "Do you sell rye bread?", None)
            a2 = ask(c, "Is it sliced?", a1.id)
            b1 = ask(c, "What is two and two?", None)
            ask(c, "And three and three?", b1.id)
            l1 = ask(c, "Name a colour.", None)  # (a first turn is the prompt cache's: continued)
            l2 = ask(c, "And another?", l1.id)
    # the worker left each conversation's KV in the folder when it stopped
    assert chain_file(a1).is_file() and chain_file(b1).is_file() and chain_file(l1).is_file()
    # the third chain goes while the server is down (no pool to tell): its file is swept at start
    down = ResponseStore(home / "data" / "responses.sqlite3")
    assert down.delete(l1.id) and down.delete(l2.id)
    with serving(home, config=config, key=KEY) as server:
        server.wait_ready([SMOL])
        assert not chain_file(l1).exists()
        assert chain_file(a1).is_file() and chain_file(b1).is_file()
        with client(server) as c:
            c.responses.delete(a2.id)  # a1 is still stored: the chain's KV stays
            assert chain_file(a1).is_file()
            c.responses.delete(a1.id)  # the last of the chain: its KV files go
            assert not chain_file(a1).exists()
            assert c.responses.retrieve(b1.id).id == b1.id
    # a worker that held the deleted chain's sequence may save it again when it stops: the next
    # start sweeps it; the other chain's file stays
    with serving(home, config=config, key=KEY) as server:
        server.wait_ready([SMOL])
        assert not chain_file(a1).exists()
        assert chain_file(b1).is_file()
