"""Codex CLI on `timeshare serve`'s /v1/responses (issue 42's "Real clients").

The request bodies Codex CLI 0.171.0 sent to Timeshare as a custom provider (``wire_api =
"responses"``; captured by scripts/lab/codex_on_timeshare.sh through its logging proxy, scrubbed
by scripts/lab/codex_scrub.py: paths and ids made fake, the long instruction texts cut) are
replayed with httpx exactly as sent (only ``model`` named), and the streams checked against what
Codex's parser reads: named events in ``sequence_number`` order, ``response.created`` and
``in_progress`` first, every output item added then done with its parts and deltas adding up, and
``response.completed`` (or ``response.incomplete`` with its reason) last holding the items.

- ``first-turn.json``: the first request of ``codex exec`` (``store: false``, ``include:
  ["reasoning.encrypted_content"]``, ``reasoning``, ``prompt_cache_key``, ``client_metadata``,
  ``parallel_tool_calls``, two developer messages, item ids, function tools and a ``namespace``
  tool of sub-agent functions);
- ``tool-outputs.json``: the request after the model's calls ran: Codex replays the whole history
  (the calls as ``function_call`` items with ``status``, their results as
  ``function_call_output``), so its prefix is the first turn's, kept in the prompt cache;
- ``first-turn-web-search.json``: the first request with Codex's default config, which offers
  OpenAI's hosted ``web_search``: a 400 naming it and saying how Codex turns it off.

The last test runs the real ``codex exec`` when a ``codex`` binary is on PATH (skipped otherwise).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _api_util import GEMMA, SMOL, Served, seed_gemma_cache, serving

pytestmark = pytest.mark.slow

KEY = "codex-key"
CAP = 48  # the models' max_tokens: Codex sends no max_output_tokens
DATA = Path(__file__).parent / "data" / "codex"
CODEX_EXEC = ("codex", "exec", "--skip-git-repo-check", "--ephemeral", "-s", "read-only", "--json")


def _body(name: str, model: str = SMOL) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((DATA / name).read_text())
    assert body["model"] == "MODEL"
    body["model"] = model
    return body


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("codex-home")
    seed_gemma_cache(home, gemma3_path)
    config = home / "elsewhere" / "timeshare.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        f'[api]\nkey = "{KEY}"\n\n'
        f'[[models]]\nid = "{SMOL}"\npath = "{smollm2_path}"\nn_ctx = 8192\nmax_tokens = {CAP}\n\n'
        # Codex's whole prompt (about 9k tokens) for the real codex exec
        f'[[models]]\nid = "{GEMMA}"\npath = "{gemma3_path}"\nn_ctx = 16384\nmax_tokens = {CAP}\n'
    )
    with serving(home, config=config, key=KEY) as server:
        server.wait_ready([SMOL, GEMMA])
        yield server
        assert server.proc.poll() is None, server.log_text()[-3000:]
    assert server.proc.returncode == 0, server.log_text()[-3000:]


def _stream(served: Served, body: dict[str, Any]) -> tuple[int, list[tuple[str, dict[str, Any]]], bytes]:
    """POST the body as Codex does (accept: text/event-stream): the status, the SSE events (name,
    data) of a 200, the raw body otherwise."""
    headers = {"Authorization": f"Bearer {KEY}", "Accept": "text/event-stream"}
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", f"{served.url}/v1/responses", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code, [], r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name, data = None, []
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].strip())
            elif not line and data:
                assert name is not None, data
                events.append((name, json.loads("\n".join(data))))
                name, data = None, []
    return 200, events, b""


def _check_sequence(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The stream as Codex's parser reads it; the final response object."""
    assert events, "an empty stream"
    for name, data in events:
        assert data["type"] == name
    assert [d["sequence_number"] for _, d in events] == list(range(1, len(events) + 1))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"], names[:5]
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    last, final = events[-1]
    assert last in ("response.completed", "response.incomplete"), names[-5:]
    response = final["response"]
    assert response["id"] == created["id"] and response["object"] == "response"
    assert names.count(last) == 1 and "error" not in names and "response.failed" not in names
    done: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None
    text = arguments = ""
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert open_item is None and data["output_index"] == len(done)
            open_item, text, arguments = data["item"], "", ""
        elif name == "response.output_item.done":
            assert open_item is not None and data["item"]["id"] == open_item["id"]
            item = data["item"]
            if item["type"] == "message":
                assert item["content"][0]["text"] == text
            elif item["type"] == "function_call":
                assert item["arguments"] == arguments and item["call_id"].startswith("call_")
            done.append(item)
            open_item = None
        else:
            assert open_item is not None, f"{name} outside an item"
            assert data["item_id"] == open_item["id"] and data["output_index"] == len(done)
            if name == "response.output_text.delta":
                text += data["delta"]
            elif name == "response.output_text.done":
                assert data["text"] == text
            elif name == "response.function_call_arguments.delta":
                arguments += data["delta"]
            elif name == "response.function_call_arguments.done":
                assert data["arguments"] == arguments
            else:
                assert name in ("response.content_part.added", "response.content_part.done"), name
    assert open_item is None
    assert response["output"] == done and done
    usage = response["usage"]
    assert (
        usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    )
    if last == "response.incomplete":  # the model wrote up to its max_tokens
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert usage["output_tokens"] == CAP
    else:
        assert response["status"] == "completed" and usage["output_tokens"] <= CAP
    result: dict[str, Any] = response
    return result


def test_codex_first_turn_is_answered_with_the_stream_codex_reads(served: Served) -> None:
    body = _body("first-turn.json")
    status, events, raw = _stream(served, body)
    assert status == 200, raw
    response = _check_sequence(events)
    assert response["store"] is False and response["parallel_tool_calls"] is True
    assert response["tools"] == body["tools"]  # the namespace tool included, as given
    assert response["model"] == SMOL
    # store: false: nothing kept
    gone = httpx.get(
        f"{served.url}/v1/responses/{response['id']}", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert gone.status_code == 404


def test_codex_tool_outputs_turn_is_answered_and_reuses_the_first_turns_kv(served: Served) -> None:
    first = _body("first-turn.json")
    status, events, raw = _stream(served, first)
    assert status == 200, raw
    _check_sequence(events)
    body = _body("tool-outputs.json")
    kinds = [item["type"] for item in body["input"]]
    assert "function_call" in kinds and "function_call_output" in kinds
    status, events, raw = _stream(served, body)
    assert status == 200, raw
    response = _check_sequence(events)
    # Codex replays the whole history (store: false); the prompt cache holds the first turn's
    cached = response["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached > 0, response["usage"]
    assert response["timeshare"]["prompt_tokens_evaluated"] == response["usage"]["input_tokens"] - cached


def test_a_call_of_a_namespaced_function_carries_its_namespace(served: Served) -> None:
    """Codex routes a call of a function of a ``namespace`` tool by the namespace and the name
    (the body is Codex's first turn with ``tool_choice`` naming one, so the model calls it)."""
    body = _body("first-turn.json")
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    name = namespace["tools"][0]["name"]
    body["tool_choice"] = {"type": "function", "name": name}
    status, events, raw = _stream(served, body)
    assert status == 200, raw
    response = _check_sequence(events)
    (call,) = [item for item in response["output"] if item["type"] == "function_call"][:1]
    assert (call["name"], call["namespace"]) == (name, namespace["name"])
    added = next(d["item"] for n, d in events if n == "response.output_item.added")
    assert added["namespace"] == namespace["name"]


def test_codex_default_web_search_tool_is_a_400_saying_how_to_turn_it_off(served: Served) -> None:
    body = _body("first-turn-web-search.json")
    index = next(i for i, t in enumerate(body["tools"]) if t["type"] == "web_search")
    status, _, raw = _stream(served, body)
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == f"tools[{index}].type"
    assert "web_search" in error["message"] and 'web_search = "disabled"' in error["message"]
    # nothing lost: the same request without the hosted tool is answered
    body["tools"] = [t for t in body["tools"] if t["type"] != "web_search"]
    status, events, raw = _stream(served, body)
    assert status == 200, raw
    _check_sequence(events)


def test_the_captured_bodies_are_what_codex_sends() -> None:
    """The data keeps every field Codex sent (a guard against a scrub that dropped one)."""
    body = _body("first-turn.json")
    assert {
        "include",
        "reasoning",
        "store",
        "prompt_cache_key",
        "client_metadata",
        "parallel_tool_calls",
    } <= set(body)
    assert body["store"] is False and body["stream"] is True
    assert [t["type"] for t in body["tools"]].count("namespace") == 1
    assert all(item.get("id") for item in body["input"])  # item ids, although store is false


@pytest.mark.skipif(
    shutil.which("codex") is None, reason="no codex binary on PATH (npm install -g @openai/codex)"
)
def test_codex_exec_reads_a_file_through_timeshare(served: Served, tmp_path: Path) -> None:
    """The real Codex CLI, ``codex exec`` in a read-only sandbox, on Gemma-3-270M: every request it
    sends is answered. The tiny model seldom does the task (it may ramble into its max_tokens,
    which Codex reports as an incomplete response): that is the model's, not the protocol's."""
    codex_home, work = tmp_path / "codex-home", tmp_path / "work"
    codex_home.mkdir()
    work.mkdir()
    (work / "notes.txt").write_text("The secret word is PELICAN.\n")
    (codex_home / "config.toml").write_text(
        f'model_provider = "timeshare"\nmodel = "{GEMMA}"\nweb_search = "disabled"\n\n'
        "[model_providers.timeshare]\n"
        f'name = "Timeshare"\nbase_url = "{served.url}/v1"\nwire_api = "responses"\n'
        'env_key = "TIMESHARE_API_KEY"\n'
    )
    env = {**served.env, "CODEX_HOME": str(codex_home), "TIMESHARE_API_KEY": KEY}
    run = subprocess.run(
        [*CODEX_EXEC, "Read notes.txt and tell me the secret word."],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert "turn.started" in kinds, run.stdout[-3000:] + run.stderr[-3000:]
    errors = [e["message"] for e in events if e["type"] == "error"]
    # the only error allowed is the tiny model's: its answer ran into max_tokens
    assert all("Incomplete response returned, reason: max_output_tokens" in m for m in errors), errors
    assert ("turn.completed" in kinds) or errors, kinds
