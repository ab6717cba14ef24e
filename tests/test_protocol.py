"""Protocol framing between pool and worker: round trips, and garbage in every shape never hangs
or crashes the reader (it raises FrameError, recoverable only when the frame boundary held)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import types
import typing
from typing import Any, Literal, Union

import msgspec
import pytest
from _proc_util import thread_wchan, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeshare.core.errors import FrameError, ProtocolError
from timeshare.core.sampling import Sampling
from timeshare.core.wire import protocol as p

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return st.none()
    if origin is Union or origin is types.UnionType:
        return st.one_of(*(strategy_for(a) for a in typing.get_args(tp)))
    if origin is Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**40), 2**40)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp is str:
        return _text
    if tp is bytes:
        return st.binary(max_size=8)
    assert isinstance(tp, type) and issubclass(tp, msgspec.Struct), tp
    hints = typing.get_type_hints(tp)
    return st.builds(tp, **{name: strategy_for(hints[name]) for name in tp.__struct_fields__})


def valid_generate() -> st.SearchStrategy[p.Generate]:
    # (images: their places must lie in their text; test_images_and_their_places checks them)
    message = strategy_for(p.ChatMessage).map(lambda m: msgspec.structs.replace(m, images=()))
    chat = st.lists(message, min_size=1, max_size=3).map(tuple)
    sampling = st.builds(
        Sampling,
        max_tokens=st.none() | st.integers(1, 4096),
        temperature=st.floats(0, 2),
        top_p=st.floats(0.01, 1.0),
        top_k=st.integers(0, 100),
        seed=st.none() | st.integers(0, 2**32 - 1),
        stop=st.lists(_text.filter(bool), max_size=3).map(tuple),
    )
    return st.builds(
        p.Generate,
        req=_text,
        prompt=st.none(),
        messages=chat,
        sampling=sampling,
        conversation=st.none() | _text.filter(bool),
    ) | st.builds(
        p.Generate, req=_text, prompt=_text, sampling=st.builds(Sampling, max_tokens=st.integers(1, 10))
    )


ANY_MESSAGE = st.one_of(
    valid_generate(),
    *(strategy_for(cls) for cls in (*p.REQUEST_TYPES, *p.EVENT_TYPES) if cls is not p.Generate),
)


@FAST
@given(ANY_MESSAGE)
def test_every_message_round_trips(msg: object) -> None:
    frame = p.encode(msg)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    decoder = p.FrameDecoder()
    decoder.feed(frame)
    assert decoder.next() == msg
    assert decoder.next() is None
    decoder.eof()  # nothing left over


def test_a_done_carries_the_switch_fields_the_worker_measured() -> None:
    # the pool's SwitchStats adds prompt_tokens_evaluated; release_ms is the previous holder's,
    # which the worker's grant of the token carried from the arena
    switch = p.SwitchMeasured(
        True, wait_ms=1.5, restore_ms=2.5, first_token_ms=3.5, restored_bytes=4096, release_ms=9.0
    )
    done = p.Done("r1", "stop", p.Usage(10, 2, 7), switch)
    obj = json.loads(p.encode(done)[4:])
    assert obj["switch"] == {
        "switched": True,
        "wait_ms": 1.5,
        "restore_ms": 2.5,
        "first_token_ms": 3.5,
        "restored_bytes": 4096,  # only what a partial release lost, after one
        "release_ms": 9.0,
    }
    got = p.from_dict(obj)
    assert isinstance(got, p.Done) and got.switch == switch
    del obj["switch"]["release_ms"]  # a worker that predates the field: none known
    got = p.from_dict(obj)
    assert isinstance(got, p.Done) and got.switch == p.SwitchMeasured(True, 1.5, 2.5, 3.5, 4096)
    assert got.switch.release_ms == 0.0


@FAST
@given(st.lists(ANY_MESSAGE, min_size=1, max_size=5), st.data())
def test_split_stream_reassembles(msgs: list[object], data: st.DataObject) -> None:
    stream = b"".join(p.encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    decoder = p.FrameDecoder()
    out = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[prev:cut])
        prev = cut
        while (m := decoder.next()) is not None:
            out.append(m)
    assert out == msgs


@FAST
@given(st.binary(max_size=300), st.integers(1, 64))
def test_decoder_fuzz_garbage_never_hangs_or_crashes(blob: bytes, chunk: int) -> None:
    decoder = p.FrameDecoder(max_frame=4096)
    steps = 0
    try:
        for i in range(0, len(blob), chunk):
            decoder.feed(blob[i : i + chunk])
            while True:
                steps += 1
                assert steps < 10_000
                try:
                    if decoder.next() is None:
                        break
                except FrameError as exc:
                    if not exc.recoverable:
                        raise
        decoder.eof()
    except FrameError as exc:
        assert str(exc).startswith("protocol:")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_text, children, max_size=3),
    max_leaves=10,
)


@FAST
@given(
    st.sampled_from(sorted(p.MESSAGE_TYPES)) | _text,
    st.dictionaries(
        st.sampled_from(["req", "prompt", "messages", "sampling", "level", "status"]) | _text, json_values
    ),
    st.sampled_from([1, 1, 1, 2, 0, "1", None, True]),
)
def test_validation_fuzz_json_objects(name: str, fields: dict[str, Any], version: object) -> None:
    """Well-framed JSON with random types/fields: a message or a recoverable FrameError, nothing else."""
    payload = json.dumps({**fields, "v": version, "type": name}).encode()
    try:
        msg = p.decode_payload(payload)
    except FrameError as exc:
        assert exc.recoverable
        assert str(exc).startswith("protocol:")
    else:
        assert version == 1 and version is not True
        assert type(msg).__name__ == name
        assert p.decode_payload(p.encode(msg)[4:]) == msg  # whatever was accepted is re-encodable


def frame(obj: object) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def test_unknown_version_is_recoverable_and_names_the_request() -> None:
    with pytest.raises(FrameError, match="version 99 is not supported") as info:
        p.decode_payload(json.dumps({"v": 99, "type": "Cancel", "req": "r7"}).encode())
    assert info.value.recoverable and info.value.req == "r7"
    assert info.value.code == "protocol"


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"{not json", "not UTF-8 JSON"),
        (b"[1, 2]", "must hold a JSON object"),
        (b'{"v": 1, "type": "Explode"}', "unknown message type 'Explode'"),
        (b'{"v": 1, "type": "Cancel"}', "Cancel.req: missing"),
        (b'{"v": 1, "type": "Cancel", "req": 5}', "Cancel.req: expected a string"),
        (b'{"v": 1, "type": "Sleep", "level": "deep"}', "Sleep.level: expected one of"),
        (
            b'{"v": 1, "type": "Generate", "req": "a", "prompt": "x", "sampling": {"max_tokens": 0}}',
            "max_tokens: must be",
        ),
        (b'{"v": 1, "type": "Generate", "req": "a"}', "exactly one of prompt"),
        (
            b'{"v": 1, "type": "Generate", "req": "a", "prompt": "x", "sampling": {"temperature": NaN}}',
            "not UTF-8 JSON",
        ),
        (b'{"v": 1, "type": "Generate", "req": "a", "prompt": "x", "sampling": {"top_p": 1e999}}', "finite"),
        (
            b'{"v": 1, "type": "Generate", "req": "a", "prompt": "x", "sampling": {"top_p": 1'
            + b"0" * 400
            + b"}}",
            "finite",
        ),
        # the fast path (a frame as encode makes it) says the same as the slow one
        (
            p.encode(p.Generate(req="a", prompt="x"))[4:].replace(b'"max_tokens":256', b'"max_tokens":0'),
            "max_tokens: must be",
        ),
        (p.encode(p.Cancel("a"))[4:].replace(b'"a"', b'"\\ud800"'), "not valid Unicode"),
        (b'{"v": 1, "type": "Cancel", "req": "\\ud800"}', "not valid Unicode"),
        (b"[" * 100_000 + b"]" * 100_000, "not UTF-8 JSON"),
    ],
)
def test_bad_frames_are_recoverable_errors_with_a_clear_message(body: bytes, message: str) -> None:
    decoder = p.FrameDecoder()
    decoder.feed(frame(body) + p.encode(p.Cancel("next")))
    with pytest.raises(FrameError, match=message) as info:
        decoder.next()
    assert info.value.recoverable
    assert decoder.next() == p.Cancel("next")  # the stream stays in sync


def test_oversize_length_breaks_the_stream() -> None:
    decoder = p.FrameDecoder(max_frame=1024)
    decoder.feed(struct.pack(">I", 1025) + b"x" * 10)
    with pytest.raises(FrameError, match="over the 1024-byte limit") as info:
        decoder.next()
    assert not info.value.recoverable
    with pytest.raises(FrameError, match="out of sync"):
        decoder.next()


def test_truncated_frame_at_eof() -> None:
    decoder = p.FrameDecoder()
    decoder.feed(p.encode(p.Cancel("a"))[:-3])
    assert decoder.next() is None
    with pytest.raises(FrameError, match="ended inside a frame"):
        decoder.eof()


def test_encode_refuses_what_it_cannot_frame() -> None:
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        p.encode(p.Loading("model", float("nan")))
    with pytest.raises(ProtocolError, match="frame limit"):
        p.encode(p.Generate(req="a", prompt="x" * (p.MAX_FRAME + 1)))
    with pytest.raises(TypeError):
        p.encode(object())


def test_connection_over_a_socketpair() -> None:
    a, b = socket.socketpair()
    ca, cb = p.Connection(a), p.Connection(b)
    try:
        ca.send(p.Hello(pid=1, model_id="m"))
        a.sendall(frame(b"garbage"))
        ca.send(p.Token(req="r", text="héllo"))
        assert cb.recv() == p.Hello(pid=1, model_id="m")
        with pytest.raises(FrameError) as info:
            cb.recv()
        assert info.value.recoverable
        assert cb.recv() == p.Token(req="r", text="héllo")
        a.sendall(p.encode(p.Cancel("x"))[:7])  # truncated, then the peer goes away
        ca.close()
        with pytest.raises(FrameError, match="ended inside a frame"):
            cb.recv()
        assert cb.recv() is None
    finally:
        cb.close()


def test_connection_reader_returns_none_when_peer_closes_while_blocked() -> None:
    a, b = socket.socketpair()
    cb = p.Connection(b)
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(cb.recv()))
    reader.start()

    def in_recv() -> bool:  # asleep in the kernel inside recv(2) on the socket, not merely started
        tid = reader.native_id
        return tid is not None and thread_wchan(tid).startswith("unix_stream")

    wait_until(in_recv, 20, "the reader blocked in recv")  # then the peer's close must wake it
    a.close()
    reader.join(10)
    assert not reader.is_alive()
    assert result == [None]
    cb.close()


def test_images_and_their_places() -> None:
    """Issue 41: a message's or a prompt's images travel as the client's bytes with their place in
    the text; a place outside the text, out of order, images outside a completion prompt's or
    more than MAX_IMAGES are refused at the frame."""
    img = p.ImagePart(b"\x89PNG...", 3)
    ok = p.Generate(req="r", messages=(p.ChatMessage("user", "abc def", images=(img, p.ImagePart(b"x", 7))),))
    decoder = p.FrameDecoder()
    decoder.feed(p.encode(ok))
    assert decoder.next() == ok and ok.image_count == 2
    bad = [
        p.Generate(req="r", messages=(p.ChatMessage("user", "ab", images=(img,)),)),  # 3 > len("ab")
        p.Generate(req="r", messages=(p.ChatMessage("user", "abcdef", images=(img, p.ImagePart(b"x", 1))),)),
        p.Generate(req="r", messages=(p.ChatMessage("user", "abc"),), images=(img,)),
        p.Generate(req="r", prompt="abc", images=(p.ImagePart(b"x", 0),) * (p.MAX_IMAGES + 1)),
    ]
    for msg in bad:
        decoder = p.FrameDecoder()
        decoder.feed(p.encode(msg))
        with pytest.raises(FrameError, match="invalid Generate"):
            decoder.next()
