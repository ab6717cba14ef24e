"""The Responses API's pieces without a server: the stored responses (chains, bounds, a restart),
the request's translation and its refusals (each a 400 naming the field), and the output items and
stream events an answer's events make. End to end with real clients: tests/test_api_responses.py."""

from __future__ import annotations

import base64
import dataclasses
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from _vision_util import png
from timeshare.core.api.errors import BadRequestError
from timeshare.core.api.requests import parse_chat_request
from timeshare.core.api.response_output import Output
from timeshare.core.api.response_store import (
    DAY_S,
    BrokenChainError,
    ChainTooLongError,
    ResponseStore,
    StoredResponse,
)
from timeshare.core.api.responses import MAX_INPUT_ITEMS, generation_request, parse
from timeshare.core.chatformat.parse import Event, ParsedCall
from timeshare.core.wire.protocol import ChatMessage, ImagePart, ToolCall

RED, BLUE = png((255, 0, 0)), png((0, 0, 255))
RED_URL = "data:image/png;base64," + base64.b64encode(RED).decode()
BLUE_URL = "data:image/png;base64," + base64.b64encode(BLUE).decode()

# ---- the store -----------------------------------------------------------------------------------


def _record(
    rid: str, previous: str | None = None, depth: int = 1, created: float | None = None
) -> StoredResponse:
    return StoredResponse(
        id=rid,
        model="smol",
        created=time.time() if created is None else created,
        previous=previous,
        conversation="responses-root",
        depth=depth,
        turn=(ChatMessage("user", f"question {rid}"), ChatMessage("assistant", f"answer {rid}")),
        input_items=({"type": "message", "id": f"msg_{rid}", "role": "user", "content": f"question {rid}"},),
        body={"id": rid, "object": "response"},
    )


def _chain(store: ResponseStore, n: int) -> None:
    """A chain r0 <- r1 <- ... <- r(n-1), written in one transaction (a test's shortcut)."""
    db = sqlite3.connect(store.path)
    store.get("r-none")  # creates the schema
    now = time.time()
    rows = []
    for i in range(n):
        r = _record(f"r{i}", f"r{i - 1}" if i else None, i + 1, now + i * 1e-3)
        rows.append(
            (
                r.id,
                r.model,
                r.created,
                r.previous,
                r.conversation,
                r.depth,
                json.dumps([{"role": m.role, "content": m.content} for m in r.turn]),
                json.dumps(list(r.input_items)),
                json.dumps(r.body),
            )
        )
    with db:
        db.executemany("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.close()


def test_a_stored_response_comes_back_after_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path)
    store.put(_record("a"))
    store.put(_record("b", "a", 2))
    store.close()
    again = ResponseStore(path)
    b = again.get("b")
    assert b is not None and b.previous == "a" and b.depth == 2 and b.turn[1].content == "answer b"
    assert [r.id for r in again.chain("b", 10)] == ["a", "b"]
    assert again.delete("a") and not again.delete("a")
    with pytest.raises(BrokenChainError) as broken:
        again.chain("b", 10)
    assert broken.value.missing == "a"
    assert again.chain("nothing", 10) == []


def test_a_chain_a_thousand_deep_is_read_without_recursion(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3", keep=10_000)
    _chain(store, 1000)
    chain = store.chain("r999", MAX_INPUT_ITEMS)
    assert [r.id for r in chain] == [f"r{i}" for i in range(1000)]
    with pytest.raises(ChainTooLongError):
        store.chain("r999", 999)
    assert len(store.chain("r998", 999)) == 999


def test_the_bounds_forget_the_oldest_and_the_too_old(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3", keep=3, days=1)
    now = time.time()
    store.put(_record("ancient", created=now - 2 * DAY_S))
    assert store.get("ancient") is None  # older than a day: gone at once
    for i in range(5):
        store.put(_record(f"n{i}", created=now + i))
    assert store.count() == 3
    assert [store.get(f"n{i}") is not None for i in range(5)] == [False, False, True, True, True]
    off = ResponseStore(tmp_path / "none.sqlite3", keep=0)
    off.put(_record("x"))
    assert off.get("x") is None


def test_a_file_that_is_no_database_is_refused_untouched(tmp_path: Path) -> None:
    from timeshare.core.errors import StoreError

    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="move it aside"):
        ResponseStore(path).get("x")
    assert path.read_bytes() == b"not a database at all" * 100


# ---- the request ---------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_items_become_the_chat_messages_the_template_renders() -> None:
    body = {
        "model": "smol",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather "},
                    {"type": "input_text", "text": "in Oslo?"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain, 9 C"},
        ],
        "tools": [WEATHER],
        "max_output_tokens": 20,
        "temperature": 0,
    }
    r = parse(body)
    req = generation_request(r, "smol", (), None)
    assert req.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("system", "Use metric units."),
        ChatMessage("user", "Weather in Oslo?"),
        ChatMessage("assistant", "Let me look.", (ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),)),
        ChatMessage("tool", "rain, 9 C", tool_call_id="call_1", name="get_weather"),
    )
    assert (req.sampling.max_tokens, req.sampling.temperature) == (20, 0.0)
    assert req.conversation is None and req.cache_prompt is None
    assert r.tools is not None and r.tools.choice == "auto" and not r.tools.parallel
    # the stored input items carry ids
    assert all(item.get("id") for item in r.input_items)


def test_an_input_image_is_the_image_part_chat_completions_makes(tmp_path: Path) -> None:
    """``input_image`` parts (a data: URL) become the images among the user's text, where they
    stood, as /v1/chat/completions' image_url parts do (the one check of core/api/images.py); the
    stored input items keep them as given, and a stored turn (its ChatMessages, images included)
    comes back from the store to continue the chain."""
    content = [
        {"type": "input_text", "text": "Compare "},
        {"type": "input_image", "image_url": RED_URL, "detail": "auto"},
        {"type": "input_text", "text": " and "},
        {"type": "input_image", "image_url": {"url": BLUE_URL}},
        {"type": "input_text", "text": "."},
    ]
    r = parse({"model": "m", "input": [{"role": "user", "content": content}]})
    chat = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Compare "},
                        {"type": "image_url", "image_url": {"url": RED_URL}},
                        {"type": "text", "text": " and "},
                        {"type": "image_url", "image_url": {"url": BLUE_URL}},
                        {"type": "text", "text": "."},
                    ],
                }
            ],
        }
    )
    req = generation_request(r, "m", (), None)
    assert req.messages == chat.messages and req.image_count == 2
    assert req.messages[0].images == (ImagePart(RED, 8), ImagePart(BLUE, 13))
    assert r.input_items[0]["content"] == content  # as given
    # the chain's next turn: the stored turn (images included) comes back as its history
    store = ResponseStore(tmp_path / "responses.sqlite3")
    record = StoredResponse(
        id="resp_img",
        model="m",
        created=time.time(),
        previous=None,
        conversation="responses-resp_img",
        depth=1,
        turn=(*r.turn_input, ChatMessage("assistant", "Red and blue.")),
        input_items=r.input_items,
        body={},
    )
    store.put(record)
    earlier = tuple(m for x in store.chain("resp_img", 10) for m in x.turn)
    assert earlier == record.turn and earlier[0].images == req.messages[0].images
    stored = store.get("resp_img")
    assert stored is not None and stored.input_items == r.input_items
    follow = parse({"model": "m", "input": "Which is warmer?"}, earlier)
    again = generation_request(follow, "m", earlier, "responses-resp_img")
    assert again.messages is not None and again.messages[0].images == req.messages[0].images
    assert again.image_count == 2
    store.close()
    # the chain's images count toward the request's limit
    too_many = [{"type": "input_image", "image_url": RED_URL}] * 15
    with pytest.raises(BadRequestError) as refused:
        parse({"model": "m", "input": [{"role": "user", "content": too_many}]}, earlier)
    assert refused.value.param == "input[0].content[14]"
    assert "previous_response_id continues hold 2" in refused.value.message


def test_a_continuation_goes_to_the_chain_conversation_and_may_answer_its_calls() -> None:
    earlier = (
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", (ToolCall("call_9", "get_weather", "{}"),)),
    )
    r = parse(
        {"model": "smol", "input": [{"type": "function_call_output", "call_id": "call_9", "output": "sun"}]},
        earlier,
    )
    req = generation_request(r, "smol", earlier, "responses-resp_1")
    assert req.messages is not None and req.messages[-1] == ChatMessage(
        "tool", "sun", tool_call_id="call_9", name="get_weather"
    )
    assert (req.conversation, req.cache_prompt) == ("responses-resp_1", True)


def test_text_format_and_tool_choice_map_onto_the_shared_grammars() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = parse(
        {
            "model": "m",
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "N", "schema": schema, "strict": True}},
        }
    )
    assert generation_request(r, "m", (), None).sampling.grammar
    r = parse({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}})
    assert generation_request(r, "m", (), None).sampling.grammar
    named = parse(
        {
            "model": "m",
            "input": "x",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    assert named.tools is not None and (named.tools.choice, named.tools.named) == ("required", "get_weather")
    other = {**WEATHER, "name": "get_time"}
    allowed = parse(
        {
            "model": "m",
            "input": "x",
            "tools": [WEATHER, other],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_time"}],
            },
        }
    )
    assert allowed.tools is not None and allowed.tools.choice == "required"
    assert [t["function"]["name"] for t in allowed.tools.tools] == ["get_time"]
    assert parse({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": "none"}).tools is None
    logprobs = parse(
        {"model": "m", "input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    )
    sampling = generation_request(logprobs, "m", (), None).sampling
    assert sampling.logprobs and sampling.top_logprobs == 2


REFUSALS: list[tuple[dict[str, Any], str, str]] = [
    ({"input": "x"}, "model", "'model' is required"),
    ({"model": "m"}, "input", "'input' is empty"),
    ({"model": "m", "input": 3}, "input", "'input' must be a string or a list"),
    ({"model": "m", "input": "x", "background": True}, "background", "'background' is not supported"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"model": "m", "input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt template"),
    (
        {"model": "m", "input": "x", "tools": [{"type": "web_search"}]},
        "tools[0].type",
        "hosted tool 'web_search'",
    ),
    (
        {"model": "m", "input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]},
        "tools[0].type",
        "file search",
    ),
    (
        {"model": "m", "input": "x", "tools": [{"type": "code_interpreter"}]},
        "tools[0].type",
        "code interpreter",
    ),
    (
        {"model": "m", "input": "x", "tools": [{"type": "computer_use_preview"}]},
        "tools[0].type",
        "computer use",
    ),
    ({"model": "m", "input": "x", "tools": [{"type": "mcp", "server_url": "x"}]}, "tools[0].type", "MCP"),
    ({"model": "m", "input": "x", "tools": [{"type": "gadget"}]}, "tools[0].type", "give function tools"),
    (
        {"model": "m", "input": "x", "tools": [{"type": "web_search", "external_web_access": False}]},
        "tools[0].type",
        'web_search = "disabled"',  # what Codex CLI sends unless told not to, and how
    ),
    (
        {"model": "m", "input": "x", "tools": [{"type": "namespace", "tools": []}]},
        "tools[0].name",
        "namespace",
    ),
    (
        {"model": "m", "input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": "all"}]},
        "tools[0].tools",
        "list of function tools",
    ),
    (
        {
            "model": "m",
            "input": "x",
            "tools": [
                WEATHER,
                {"type": "namespace", "name": "ns", "tools": [WEATHER, {"type": "web_search"}]},
            ],
        },
        "tools[1].tools[1].type",
        "a namespace holds function tools",
    ),
    (
        {
            "model": "m",
            "input": "x",
            "tools": [
                {"type": "namespace", "name": "a", "tools": [WEATHER]},
                {"type": "namespace", "name": "b", "tools": [WEATHER]},
            ],
        },
        "tools[1].tools[0].name",
        "also in namespace 'a'",
    ),
    (
        {
            "model": "m",
            "input": "x",
            "tools": [WEATHER, {"type": "namespace", "name": "ns", "tools": [WEATHER]}],
        },
        "tools",
        "names a function twice",
    ),
    (
        {
            "model": "m",
            "input": "x",
            "tools": [
                WEATHER,
                {"type": "namespace", "name": "ns", "tools": [{**WEATHER, "name": "bad name"}]},
            ],
        },
        "tools[1].tools[0].name",
        "letters, digits",
    ),
    (
        {"model": "m", "input": "x", "tools": [{**WEATHER, "name": "bad name"}]},
        "tools[0].name",
        "letters, digits",
    ),
    (
        {"model": "m", "input": "x", "tool_choice": {"type": "web_search_preview"}},
        "tool_choice",
        "hosted tool",
    ),
    (
        {"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
        "not in 'tools'",
    ),
    ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice", "empty"),
    ({"model": "m", "input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "not supported"),
    ({"model": "m", "input": [{"type": "gizmo"}]}, "input[0].type", "not supported"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"model": "m", "input": ["hello"]}, "input[0]", "must be an object"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'robot'"),
    (
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].image_url",
        "send a data: URL",
    ),
    (
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
        },
        "input[0].content[0].file_id",
        "no Files API",
    ),
    (
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].image_url",
        "must be a data: URL",
    ),
    (
        {
            "model": "m",
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": "https://x.test/a.png"}]}
            ],
        },
        "input[0].content[0].image_url",
        "api.fetch_image_urls is off",
    ),
    (
        {
            "model": "m",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}],
                }
            ],
        },
        "input[0].content[0].image_url",
        "not an image",
    ),
    (
        {
            "model": "m",
            "input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": RED_URL}]}],
        },
        "input[0].content[0].type",
        "only user messages",
    ),
    (
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": RED_URL}] * 17}],
        },
        "input[0].content[16]",
        "more than 16 images",
    ),
    (
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content[0].type",
        "input_file parts are not supported",
    ),
    ({"model": "m", "input": [{"role": "user", "content": 7}]}, "input[0].content", "string or a list"),
    (
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
        "input[0].call_id",
        "no function_call",
    ),
    (
        {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        "required",
    ),
    (
        {"model": "m", "input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)},
        "input",
        f"at most {MAX_INPUT_ITEMS}",
    ),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature", "from 0 to 2"),
    (
        {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
        "text.format",
        "needs 'schema'",
    ),
    ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text", "'text' must be"),
    (
        {
            "model": "m",
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}},
        },
        "text.format",
        "text.format.schema.not",
    ),
]


@pytest.mark.parametrize(("body", "param", "words"), REFUSALS)
def test_bad_requests_are_refused_naming_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        r = parse(body)
        generation_request(r, "m", (), None)
    assert refused.value.param == param, refused.value.message
    assert words in refused.value.message and refused.value.status == 400


# ---- the answer ----------------------------------------------------------------------------------


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_text_and_a_streamed_call_make_the_responses_event_sequence() -> None:
    out = Output()
    events = out.feed([Event("content", "Let me "), Event("content", "check.")])
    call = ParsedCall("get_weather", '{"city": "Oslo"}')
    events += out.feed(
        [
            Event("call_start", call=ParsedCall("get_weather", "")),
            Event("call_arguments", '{"city": '),
            Event("call_arguments", '"Oslo"}'),
            Event("call_end", call=call),
        ]
    )
    events += out.finish(incomplete=False)
    assert _types(events) == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    message, fc = out.items
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert events[0]["item"]["content"] == []  # the item as it was when added
    assert (
        fc["arguments"] == '{"city": "Oslo"}'
        and fc["call_id"].startswith("call_")
        and fc["status"] == "completed"
    )
    assert events[10]["arguments"] == fc["arguments"] and events[10]["item_id"] == fc["id"]
    assert out.message() == ChatMessage(
        "assistant", "Let me check.", (ToolCall(fc["call_id"], "get_weather", fc["arguments"]),)
    )


def test_a_namespace_tool_offers_its_functions_and_a_call_of_one_names_it() -> None:
    """Codex CLI groups its sub-agent (and MCP) tools in ``namespace`` tools: each function is
    offered under its own name, answered back as given, and a call of one carries the namespace
    (Codex routes the call by both)."""
    spawn = {**WEATHER, "name": "spawn_agent"}
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents", "tools": [spawn]}
    r = parse({"model": "m", "input": "x", "tools": [WEATHER, namespace], "tool_choice": "auto"})
    assert r.tools is not None
    assert [t["function"]["name"] for t in r.tools.tools] == ["get_weather", "spawn_agent"]
    assert r.raw_tools == (WEATHER, namespace) and r.namespaces == {"spawn_agent": "multi_agent_v1"}
    forced = parse(
        {
            "model": "m",
            "input": "x",
            "tools": [namespace],
            "tool_choice": {"type": "function", "name": "spawn_agent"},
        }
    )
    assert forced.tools is not None and forced.tools.named == "spawn_agent"
    out = Output(namespaces=r.namespaces)
    events = out.feed([Event("call", call=ParsedCall("spawn_agent", "{}"))])
    events += out.feed([Event("call", call=ParsedCall("get_weather", '{"city": "Oslo"}'))])
    events += out.finish(incomplete=False)
    spawned, weather = out.items
    assert spawned["namespace"] == "multi_agent_v1" and "namespace" not in weather
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[0]["namespace"] == "multi_agent_v1"
    # Codex replays the call with its namespace, and its output
    replay = [
        {"type": "message", "role": "user", "content": "x"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "spawn_agent",
            "namespace": "multi_agent_v1",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
    ]
    again = parse({"model": "m", "input": replay, "tools": [namespace]})
    assert again.turn_input[1].tool_calls == (ToolCall("c1", "spawn_agent", "{}"),)
    assert again.turn_input[2] == ChatMessage("tool", "spawned", tool_call_id="c1", name="spawn_agent")


def test_reasoning_becomes_a_reasoning_item_and_an_empty_answer_a_message() -> None:
    out = Output()
    events = out.feed([Event("reasoning", "Think."), Event("content", "Hi")]) + out.finish(incomplete=True)
    assert _types(events)[:3] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    reasoning, message = out.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "Think."}
    ]
    assert reasoning["status"] == "completed" and message["status"] == "incomplete"
    assert out.message() == ChatMessage("assistant", "Hi")  # earlier thinking is not shown again
    empty = Output()
    assert _types(empty.finish(incomplete=False))[-1] == "response.output_item.done"
    assert empty.items[0]["content"][0]["text"] == "" and empty.items[0]["type"] == "message"


def test_a_chains_kv_conversation_is_forgotten_with_its_last_stored_response(tmp_path: Path) -> None:
    forgotten: list[str] = []
    store = ResponseStore(tmp_path / "responses.sqlite3", keep=3, forget=forgotten.append)
    now = time.time()

    def put(rid: str, chain: str, previous: str | None = None, at: float = 0.0) -> None:
        record = dataclasses.replace(
            _record(rid, previous, created=now + at), conversation=f"responses-{chain}"
        )
        store.put(record)

    put("a1", "a1", at=1)
    put("a2", "a1", "a1", at=2)
    put("b1", "b1", at=3)
    assert not store.gone("responses-a1") and not store.gone("responses-b1")
    assert store.gone("responses-never") and not store.gone("not-a-chain")  # only a chain's shape
    assert store.delete("a2") and forgotten == []  # a1 still holds the chain
    assert not store.delete("a2") and forgotten == []
    assert store.delete("a1") and forgotten == ["responses-a1"]
    assert store.gone("responses-a1")
    # past the bounds (keep=3): the oldest go, and the chain they ended with them
    put("c1", "c1", at=4)
    put("d1", "d1", at=5)
    assert forgotten == ["responses-a1"]
    put("e1", "e1", at=6)
    assert forgotten == ["responses-a1", "responses-b1"] and store.gone("responses-b1")


def test_a_failing_forget_leaves_the_deletion_done(tmp_path: Path) -> None:
    def broken(conversation: str) -> None:
        raise OSError("the KV folder is unreadable")

    store = ResponseStore(tmp_path / "responses.sqlite3", forget=broken)
    store.put(_record("x"))
    assert store.delete("x") and store.get("x") is None
