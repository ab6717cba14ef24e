"""Damaged KV snapshot files in the KV directory: a worker that finds a garbage, truncated or
bit-flipped file for a conversation refuses it with a reason in its log, deletes it, and evaluates
the conversation again from scratch: the answer is the one a worker with no file gives, never one
computed on damaged KV. An intact file next to them is still reused (the check has teeth)."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest
from _e_worker_util import WorkerHandle
from timeshare.core.config.schema import ModelConfig
from timeshare.core.wire import protocol as p

pytestmark = pytest.mark.slow

FIRST = (p.ChatMessage("user", "Name a fruit and say what colour it is."),)
KEYS = (
    "intact",
    "garbage",
    "cut-header",
    "cut-ids",
    "cut-state",
    "flipped-state",
    "flipped-ids",
    "empty",
    "refused-state",  # a whole file (its checksum matches) whose state llama.cpp refuses
)


def _second(answer: str) -> tuple[p.ChatMessage, ...]:
    return (*FIRST, p.ChatMessage("assistant", answer), p.ChatMessage("user", "And a vegetable?"))


def _layout(data: bytes) -> tuple[int, int, int]:
    """(end of header, end of token ids, n_tokens) read from the file as its docstring describes it
    (a magic line, a big-endian u32 header length, the JSON header, int32 ids, the state bytes)."""
    magic_end = data.index(b"\n") + 1
    (hlen,) = struct.unpack_from(">I", data, magic_end)
    header_end = magic_end + 4 + hlen
    n = int(json.loads(data[magic_end + 4 : header_end])["n_tokens"])
    return header_end, header_end + 4 * n, n


def _damage(key: str, data: bytes) -> bytes:
    header_end, ids_end, n = _layout(data)
    state = len(data) - ids_end
    assert state > 4096, state
    if key == "garbage":
        return bytes((i * 151 + 7) % 256 for i in range(len(data)))
    if key == "cut-header":
        return data[: header_end - 5]
    if key == "cut-ids":
        return data[: ids_end - 6]
    if key == "cut-state":
        return data[: ids_end + state // 2]
    if key == "flipped-state":  # the KV values themselves: llama.cpp cannot tell
        middle = bytearray(data)
        for at in range(ids_end + state // 4, len(data), state // 8):
            middle[at] ^= 0x40
        return bytes(middle)
    if key == "flipped-ids":  # another token in the middle of the prompt the KV was made of
        ids = bytearray(data)
        at = header_end + 4 * (n // 2)  # the low byte of token n // 2 (little-endian int32)
        ids[at] ^= 0x01
        return bytes(ids)
    if key == "empty":
        return b""
    if key == "refused-state":  # half a state, the header rewritten to match (the format's docstring)
        magic_end = data.index(b"\n") + 1
        header = json.loads(data[magic_end + 4 : header_end])
        ids, cut = data[header_end:ids_end], data[ids_end : ids_end + state // 2]
        header.update(state_bytes=len(cut), crc32=zlib.crc32(cut, zlib.crc32(ids)))
        head = json.dumps(header).encode()
        return data[:magic_end] + struct.pack(">I", len(head)) + head + ids + cut
    raise AssertionError(key)


def test_damaged_kv_files_are_refused_and_the_conversation_is_evaluated_again(
    smollm2_path: Path, tmp_path: Path
) -> None:
    model = ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512, n_seq=len(KEYS) + 1)
    kv = tmp_path / "kv"
    first = WorkerHandle(model, tmp_path / "first", kv_dir=kv)
    try:
        first.ready()
        answers = {}
        for key in KEYS:
            answers[key], done = first.generate(f"{key}-1", messages=FIRST, max_tokens=12, conversation=key)
            assert isinstance(done, p.Done), done
        assert len(set(answers.values())) == 1  # greedy: one answer, one second turn for all
        # the reference: the second turn evaluated from an empty KV cache
        answer = answers[KEYS[0]]
        ref, ref_done = first.generate("ref", messages=_second(answer), max_tokens=8, cache_prompt=False)
        assert isinstance(ref_done, p.Done)
        assert ref_done.usage.prompt_tokens_evaluated == ref_done.usage.prompt_tokens
        first.send(p.Shutdown(save_kv=True))
        assert first.wait_exit() == 0
    finally:
        first.close()
    files = sorted(kv.glob("smol-*.kv"))
    assert len(files) == len(KEYS), files
    # which file is whose: the header names its conversation
    by_key: dict[str, Path] = {}
    for f in files:
        data = f.read_bytes()
        magic_end = data.index(b"\n") + 1
        (hlen,) = struct.unpack_from(">I", data, magic_end)
        by_key[json.loads(data[magic_end + 4 : magic_end + 4 + hlen])["conversation"]] = f
    for key in KEYS[1:]:
        by_key[key].write_bytes(_damage(key, by_key[key].read_bytes()))

    second = WorkerHandle(model, tmp_path / "second", kv_dir=kv)
    try:
        second.ready()
        for key in KEYS:
            # an empty context first (a new conversation would otherwise continue from the tokens
            # the context holds: those of the previous key's identical prompt)
            _, wipe = second.generate(f"{key}-wipe", prompt="Hi", max_tokens=1, cache_prompt=False)
            assert isinstance(wipe, p.Done)
            text, done = second.generate(f"{key}-2", messages=_second(answer), max_tokens=8, conversation=key)
            assert isinstance(done, p.Done), (key, done)
            assert not by_key[key].exists(), key  # read once (or refused) and removed
            if key == "intact":
                assert 0 < done.usage.prompt_tokens_evaluated < done.usage.prompt_tokens // 2, done
                continue
            # refused: the whole conversation evaluated again, the answer of an empty KV cache
            assert done.usage.prompt_tokens_evaluated == done.usage.prompt_tokens, (key, done)
            assert text == ref, key
        log = second.log_text()
        for key in KEYS[1:-1]:
            line = next((ln for ln in log.splitlines() if by_key[key].name in ln), None)
            assert line is not None and "ignoring saved KV" in line, (key, log[-3000:])
        assert "conversation refused-state: llama.cpp refused a KV snapshot; it is evaluated again" in log
        # and the worker keeps serving
        _, done = second.generate("after", prompt="The capital of France is", max_tokens=4)
        assert isinstance(done, p.Done)
    finally:
        second.close()
    shutil.rmtree(kv, ignore_errors=True)
