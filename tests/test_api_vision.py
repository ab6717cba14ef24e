"""Images through `timeshare serve` (issue 41, item 4), with the real openai, anthropic and ollama
clients: a SmolLM2 with a generated projector (random weights: its answers mean nothing, the
mechanics are checked) beside a text-only model. The same image and question give the same
answer through each dialect; two images differ; the answer is bitwise the same after a switch
(sleep and wake) and after a restart whose KV came back from disk; the capabilities say which
model reads images; every bad image is a 400 naming its part, and the server goes on."""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from _api_util import Served, run_cli, serving
from _vision_util import QUESTION, png, projector_for

from timeshare.image_paths import content_with_images, split_images

pytestmark = pytest.mark.slow

VISION = "smol-vision"
TEXT = "smol-text"
N = 8
RED, BLUE = png((255, 0, 0)), png((0, 0, 255))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that says it is ``width`` x ``height`` (its IHDR) and holds almost nothing: a
    decompression bomb's header, made without the pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("vision-home")
    proj = projector_for(smollm2_path, home)
    config = home / "elsewhere" / "timeshare.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        f'[[models]]\nid = "{VISION}"\nname = "Smol Vision"\npath = "{smollm2_path}"\nmmproj = "{proj}"\n'
        f"n_ctx = 1024\n\n"
        f'[[models]]\nid = "{TEXT}"\nname = "Smol Text"\npath = "{smollm2_path}"\nn_ctx = 512\n'
    )
    with serving(home, config=config) as server:
        server.wait_ready([VISION, TEXT])
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=180)


def openai_ask(client: openai.OpenAI, image: bytes, **extra: Any) -> Any:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": QUESTION},
    ]
    return client.chat.completions.create(
        model=VISION,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        **extra,
    )


def first_logprobs(response: Any) -> list[tuple[str, float]]:
    first = response.choices[0].logprobs.content[0]
    return [(t.token, t.logprob) for t in first.top_logprobs]


def test_the_capabilities_say_which_model_reads_images(served: Served) -> None:
    models = {m["id"]: m for m in httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]}
    assert "vision" in models[VISION]["capabilities"]
    assert "vision" not in models[TEXT]["capabilities"]
    show = httpx.post(f"{served.url}/api/show", json={"model": VISION}, timeout=30).json()
    assert "vision" in show["capabilities"]
    assert (
        "vision"
        not in httpx.post(f"{served.url}/api/show", json={"model": TEXT}, timeout=30).json()["capabilities"]
    )
    status = served.model_status(VISION)
    assert status["vision"] is True and int(status["projector_bytes"]) > 0  # type: ignore[call-overload]
    assert served.model_status(TEXT)["vision"] is False


def test_two_images_differ_and_one_image_repeats(client: openai.OpenAI) -> None:
    red, blue, red_again = (openai_ask(client, image) for image in (RED, BLUE, RED))
    assert first_logprobs(red) == first_logprobs(red_again)
    assert red.choices[0].message.content == red_again.choices[0].message.content
    assert first_logprobs(red) != first_logprobs(blue)


def test_the_three_dialects_give_the_same_answer(served: Served, client: openai.OpenAI) -> None:
    expected = openai_ask(client, RED).choices[0].message.content
    with anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=180) as claude:
        message = claude.messages.create(
            model=VISION,
            max_tokens=N,
            extra_body={"temperature": 0},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": base64.b64encode(RED).decode(),
                            },
                        },
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
        )
    assert message.content[0].text == expected  # type: ignore[union-attr]
    with ollama.Client(host=served.url, timeout=180) as llama:
        options = {"temperature": 0, "num_predict": N}
        chat = llama.chat(
            model=VISION, messages=[{"role": "user", "content": QUESTION, "images": [RED]}], options=options
        )
        assert chat.message.content == expected
        generated = llama.generate(model=VISION, prompt=QUESTION, images=[RED], options=options)
        assert generated.response == expected


def test_the_same_answer_after_a_switch_and_after_a_restart_with_its_kv(
    served: Served, client: openai.OpenAI
) -> None:
    before = openai_ask(client, BLUE)
    for level in ("weights", "weights+kv"):
        r = httpx.post(f"{served.url}/timeshare/v1/models/{VISION}/sleep", json={"level": level}, timeout=60)
        r.raise_for_status()
        after = openai_ask(client, BLUE)
        assert first_logprobs(after) == first_logprobs(before), level
        assert after.choices[0].message.content == before.choices[0].message.content
    # a conversation about the image, continued with and without the worker's restart between its
    # turns: the same second answer (its KV came back from disk), and only the new text evaluated
    content = [{"type": "image_url", "image_url": {"url": data_url(RED)}}, {"type": "text", "text": QUESTION}]
    turns: dict[str, Any] = {}
    for conv in ("kept", "restarted"):
        first = openai_ask(client, RED, extra_body={"conversation": conv})
        turns[conv] = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": first.choices[0].message.content},
        ]
    httpx.post(
        f"{served.url}/timeshare/v1/models/{VISION}/sleep", json={"level": "stop"}, timeout=60
    ).raise_for_status()
    served.wait_until(lambda s: served.model_status(VISION)["state"] == "stopped", "the vision model to stop")
    answers = {}
    for conv in ("restarted", "kept"):
        messages = [*turns[conv], {"role": "user", "content": "And the colour?"}]
        answers[conv] = client.chat.completions.create(
            model=VISION,
            messages=messages,
            max_tokens=N,
            temperature=0,
            logprobs=True,
            top_logprobs=5,  # type: ignore[arg-type]
            extra_body={"conversation": conv},
        )
    assert first_logprobs(answers["restarted"]) == first_logprobs(answers["kept"])
    evaluated = answers["restarted"].model_extra["timeshare"]["prompt_tokens_evaluated"]
    assert 0 < evaluated < answers["restarted"].usage.prompt_tokens - 16  # the image was not evaluated again


LOGPROBS = ["message.output_text.logprobs"]


def image_input(image: bytes, text: str = QUESTION) -> list[dict[str, Any]]:
    """A Responses ``input``: one user message of an ``input_image`` and the text."""
    content = [{"type": "input_image", "image_url": data_url(image)}, {"type": "input_text", "text": text}]
    return [{"role": "user", "content": content}]


def responses_first_logprobs(response: Any) -> list[tuple[str, float]]:
    first = response.output[0].content[0].logprobs[0]
    return [(t.token, t.logprob) for t in first.top_logprobs]


def test_the_responses_api_reads_images_as_chat_completions_do(served: Served, client: openai.OpenAI) -> None:
    """/v1/responses' input_image parts: the same greedy answer and first-token logprobs as the
    same image through chat completions (and another image answers otherwise); the stored input
    items give the image back as sent; a previous_response_id turn replays the image from the
    store, answering as the same two turns through chat completions in one conversation do; a
    file_id, or an image for a text model, is a 400 naming the field, and nothing else is lost."""
    ask: dict[str, Any] = {
        "model": VISION,
        "max_output_tokens": N,
        "temperature": 0,
        "top_logprobs": 5,
        "include": LOGPROBS,
    }
    r = client.responses.create(input=image_input(RED), **ask)  # type: ignore[arg-type]
    oracle = openai_ask(client, RED)
    assert r.output_text == oracle.choices[0].message.content
    assert responses_first_logprobs(r) == first_logprobs(oracle)
    assert r.usage is not None and oracle.usage is not None
    assert r.usage.input_tokens == oracle.usage.prompt_tokens
    blue = client.responses.create(input=image_input(BLUE), store=False, **ask)  # type: ignore[arg-type]
    assert responses_first_logprobs(blue) != responses_first_logprobs(r)
    items = httpx.get(f"{served.url}/v1/responses/{r.id}/input_items", params={"order": "asc"}, timeout=30)
    assert items.status_code == 200, items.text
    stored = items.json()["data"]
    assert stored[0]["content"][0] == {"type": "input_image", "image_url": data_url(RED)}
    # the chain's next turn: the image comes back from the store (the chat oracle sends it again)
    follow = client.responses.create(
        input="And the colour?",
        previous_response_id=r.id,
        **ask,  # type: ignore[arg-type]
    )
    content = [{"type": "image_url", "image_url": {"url": data_url(RED)}}, {"type": "text", "text": QUESTION}]
    history: list[dict[str, Any]] = [{"role": "user", "content": content}]
    first = client.chat.completions.create(
        model=VISION,
        messages=history,  # type: ignore[arg-type]
        max_tokens=N,
        temperature=0,
        extra_body={"conversation": "oracle-image-chain"},
    )
    assert first.choices[0].message.content == r.output_text
    history += [
        {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "And the colour?"},
    ]
    second = client.chat.completions.create(
        model=VISION,
        messages=history,  # type: ignore[arg-type]
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"conversation": "oracle-image-chain"},
    )
    assert follow.output_text == second.choices[0].message.content
    assert responses_first_logprobs(follow) == first_logprobs(second)
    assert follow.usage is not None and second.usage is not None
    assert follow.usage.input_tokens == second.usage.prompt_tokens
    evaluated = follow.model_extra["timeshare"]["prompt_tokens_evaluated"]  # type: ignore[index]
    assert 0 < evaluated < follow.usage.input_tokens - 16  # the image was not evaluated again
    # refusals name the field
    with pytest.raises(openai.BadRequestError) as by_file:
        client.responses.create(
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-abc"}]}],  # type: ignore[list-item]
            **ask,  # type: ignore[arg-type]
        )
    assert by_file.value.param == "input[0].content[0].file_id" and "Files API" in by_file.value.message
    with pytest.raises(openai.BadRequestError) as text_model:
        client.responses.create(input=image_input(RED), **{**ask, "model": TEXT})  # type: ignore[arg-type]
    assert text_model.value.param == "input" and "Smol Text does not read images" in text_model.value.message
    again = client.responses.create(input=image_input(RED), store=False, **ask)  # type: ignore[arg-type]
    assert again.output_text == r.output_text


def bad(served: Served, content: list[dict[str, Any]], model: str = VISION) -> httpx.Response:
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ([image_part(data_url(b"hello, not an image"))], "not an image"),
        ([image_part(data_url(RED[: len(RED) // 2]))], "truncated"),
        ([image_part(data_url(png_header_only(20000, 20000)))], "larger than 50,000,000 pixels"),
        ([image_part(data_url(png_header_only(9000, 9000)))], "9000x9000 pixels"),
        ([image_part(data_url(RED))] * 100, "more than 16 images"),
        ([image_part(data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"))], "SVG"),
        ([image_part(data_url(RED, "image/jpeg"))], "says image/jpeg but holds a PNG"),
        ([image_part(data_url(RED, "text/plain"))], "not an image type"),
        ([image_part("https://example.com/cat.png")], "api.fetch_image_urls"),
        ([image_part("data:image/png,notbase64")], "must be base64"),
        (
            [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
            "only text and image_url parts",
        ),
    ],
    ids=[
        "not-an-image",
        "truncated",
        "bomb",
        "too-large",
        "100-images",
        "svg",
        "wrong-mime",
        "text-mime",
        "http",
        "plain-data",
        "audio",
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(
    served: Served, content: list[dict[str, Any]], words: str
) -> None:
    r = bad(served, content)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert "messages[0].content[" in error["message"] or "messages[0].content" in str(error.get("param")), (
        error
    )


def test_an_image_for_a_text_model_is_a_400_naming_the_model(served: Served, client: openai.OpenAI) -> None:
    r = bad(served, [image_part(data_url(RED)), {"type": "text", "text": "hi"}], model=TEXT)
    assert r.status_code == 400 and "Smol Text does not read images" in r.json()["error"]["message"]
    with ollama.Client(host=served.url, timeout=60) as llama, pytest.raises(ollama.ResponseError) as err:
        llama.chat(model=TEXT, messages=[{"role": "user", "content": "hi", "images": [RED]}])
    assert err.value.status_code == 400 and "Smol Text" in str(err.value)
    with ollama.Client(host=served.url, timeout=60) as llama, pytest.raises(ollama.ResponseError) as err:
        llama.chat(model=VISION, messages=[{"role": "user", "content": "hi", "images": [b"GIF89a-broken"]}])
    assert err.value.status_code == 400 and "messages[0].images[0]" in str(err.value)
    # nothing else was affected: both models still answer
    assert openai_ask(client, RED).choices[0].message.content
    text = client.chat.completions.create(
        model=TEXT, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert text.choices[0].finish_reason in ("stop", "length")


def test_timeshare_run_takes_an_image_path_in_the_prompt(
    served: Served, client: openai.OpenAI, tmp_path: Path
) -> None:
    """As ``ollama run`` does: ``timeshare run MODEL "question ./cat.png"`` sends the file as an
    image with the rest of the text."""
    (tmp_path / "red picture.png").write_bytes(RED)
    expected = openai_ask(client, RED).choices[0].message.content
    prompt = f'{QUESTION} "{tmp_path / "red picture.png"}"'
    done = run_cli(served.home, "run", VISION, prompt, "--max-tokens", str(N), "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected.strip()
    assert "Added image" in done.stderr


def test_image_paths_in_a_prompt(tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(RED)
    (tmp_path / "my cat.jpg").write_bytes(RED)
    assert split_images("what is this? ./cat.png", tmp_path) == ("what is this?", [tmp_path / "cat.png"])
    text, found = split_images('compare "my cat.jpg" and my\\ cat.jpg then missing.png', tmp_path)
    assert found == [tmp_path / "my cat.jpg"] * 2 and text == "compare and then missing.png"
    assert split_images("no image.png here", tmp_path) == ("no image.png here", [])
    parts = content_with_images("hi", [tmp_path / "cat.png"])
    assert isinstance(parts, list) and parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
