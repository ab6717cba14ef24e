"""The projector's restore off the first token's path (issue 41's switched-turn target), in
process on the CPU build with SmolLM2 and a generated projector (random weights: its answers
mean nothing, the mechanics are checked): the model's restore returns before the projector's
begins, which starts once the first decode is over (or at an image's encode), a text turn after it
never waits for the projector, an image turn does (and answers
bitwise as before the switch), a release joins a pending projector restore and leaves nothing
resident, and a projector that cannot come back (its allocations fail) fails the image's request
alone with the out-of-memory error, the next image restoring it.

Ordering, not timing: the projector's restore is held at a gate (a wrapper of InPlace.restore
for the projector's file) that opens only when a caller logs that it waits for it."""

from __future__ import annotations

# isort: off
import llama_cpp  # noqa: F401  (before anything that imports numpy)
# isort: on

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _vision_util import Run, alone, ask, png, projector_for
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import OutOfDeviceMemoryError
from timeshare.core.residency import Residency, ResidencyOptions, _ggml
from timeshare.core.residency.inplace import InPlace
from timeshare.core.residency.state import Weights
from timeshare.core.wire.protocol import ChatMessage
from timeshare.core.worker.engine import Engine

RED = png((255, 0, 0))
TEXT = (ChatMessage("user", "Name three colours."),)


@dataclass
class Held:
    """The projector's restores held at ``gate``; ``events`` in the order they happened."""

    projector: str
    gate: threading.Event = field(default_factory=threading.Event)
    events: list[str] = field(default_factory=list)


class OpenOnWait(logging.Handler):
    """Opens the gate when a caller logs that it waits for the projector's restore."""

    def __init__(self, held: Held) -> None:
        super().__init__(logging.DEBUG)
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("waiting for the projector's restore"):
            self.held.events.append("a caller waits")
            self.held.gate.set()


@pytest.fixture
def vision(smollm2_path: Path, tmp_path: Path) -> Iterator[tuple[Engine, Residency, Path]]:
    proj = projector_for(smollm2_path, tmp_path)
    engine = Engine.load(
        ModelConfig(id="v", path=str(smollm2_path), n_ctx=512, n_seq=4, parallel=2, mmproj=str(proj)),
        use_mmap=False,
    )
    res = Residency.attach(
        engine.llm, str(smollm2_path), ResidencyOptions(mode="inplace", host_shadow="pageable")
    )
    try:
        assert engine.vision is not None
        assert res.attach_projector(engine.vision.watch, proj), res.projector_note
        engine.vision.ready = res.projector_ready  # as the worker's tenancy wires it
        yield engine, res, proj
    finally:
        res.close()
        engine.close()


@pytest.fixture
def held(vision: tuple[Engine, Residency, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    """InPlace.restore wrapped: the projector's waits at the gate; each restore's end recorded."""
    h = Held(str(vision[2]))
    real = InPlace.restore

    def restore(self: InPlace, *args: Any, **kwargs: Any) -> int:
        mine = self.path == h.projector
        if mine:
            h.events.append("projector restore starts")
            if not h.gate.wait(120):
                h.events.append("the gate timed out")
        try:
            return real(self, *args, **kwargs)
        finally:
            h.events.append("projector restore ends" if mine else "model restore ends")

    monkeypatch.setattr(InPlace, "restore", restore)
    logger = logging.getLogger("timeshare.core.residency.projector")
    handler, level = OpenOnWait(h), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield h
    finally:
        h.gate.set()
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_text_turn_after_a_switch_does_not_wait_for_the_projector_and_an_image_turn_does(
    vision: tuple[Engine, Residency, Path], held: Held
) -> None:
    engine, res, _proj = vision
    assert engine.vision is not None
    held.gate.set()  # (the turns before the switch)
    image_before = alone(engine, messages=(ask(RED),), max_tokens=8)
    text_before = alone(engine, messages=TEXT, max_tokens=8)
    res.release()
    held.gate.clear()
    held.events.clear()
    report = res.restore()
    # the model's restore returned; the projector's is due (its bytes counted), not started: it
    # starts once the first decode is over, so that its upload does not slow that decode
    assert held.events == ["model restore ends"]
    assert report.bytes == res.weight_bytes and res.resident_bytes == res.weight_bytes
    text_after = alone(engine, messages=TEXT, max_tokens=8)
    assert held.events == ["model restore ends"]
    res.settle(decoded=True)  # as the worker does after each decode: now it starts (held)
    assert held.events == ["model restore ends", "projector restore starts"]
    # the text turn is over while the projector's restore is still held: it did not wait for it
    assert not held.gate.is_set() and "projector restore ends" not in held.events
    assert text_after.logprobs == text_before.logprobs and text_after.text == text_before.text
    engine.vision.forget_encoded()  # the restored projector encodes the image again
    encodes = engine.vision.encodes
    image_after = alone(engine, messages=(ask(RED),), max_tokens=8)
    assert engine.vision.encodes == encodes + 1
    # the image's encode waited for the projector's restore, and answers bitwise as before
    assert held.events[-2:] == ["a caller waits", "projector restore ends"], held.events
    assert image_after.logprobs == image_before.logprobs and image_after.text == image_before.text
    steps = res.restore_steps
    assert steps.projector_ms is not None and steps.projector_after_ms is not None
    assert res.resident_bytes == res.weight_bytes


def test_a_release_joins_a_pending_projector_restore_and_leaves_nothing_resident(
    vision: tuple[Engine, Residency, Path], held: Held
) -> None:
    engine, res, _proj = vision
    assert engine.vision is not None
    held.gate.set()
    image_before = alone(engine, messages=(ask(RED),), max_tokens=8)
    res.release()
    held.gate.clear()
    held.events.clear()
    res.restore()
    assert held.events == ["model restore ends"]
    report = res.release()  # before any decode: the projector's restore, due, is dropped
    assert held.events == ["model restore ends"] and res.resident_bytes == 0
    assert report.released_bytes == res.weight_bytes  # (the due projector's bytes counted resident)
    res.restore()
    res.settle(decoded=True)  # a decode ended: the projector's restore starts (held at the gate)
    assert held.events[-1] == "projector restore starts"
    report = res.release()  # the projector's restore still held: the release waits for it first
    assert held.events[-2:] == ["a caller waits", "projector restore ends"], held.events
    assert res.resident_bytes == 0 and res.state.weights is Weights.NONE
    assert report.released_bytes == res.weight_bytes
    res.restore()  # (the gate open now)
    engine.vision.forget_encoded()
    image_after = alone(engine, messages=(ask(RED),), max_tokens=8)
    assert image_after.logprobs == image_before.logprobs and image_after.text == image_before.text


def test_a_projector_that_cannot_come_back_fails_the_image_request_alone(
    vision: tuple[Engine, Residency, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight-buffer allocation on the projector's restore thread fails (the fault: the
    allocator's answer, ``_ggml.buft_alloc_buffer``): the model comes back, a text request
    beside an image answers as before, the image's request ends with OutOfDeviceMemoryError;
    with memory back, the next image restores the projector and answers bitwise as before."""
    engine, res, _proj = vision
    assert engine.vision is not None
    image_before = alone(engine, messages=(ask(RED),), max_tokens=8)
    text_before = alone(engine, messages=TEXT, max_tokens=8)
    real = _ggml.buft_alloc_buffer
    failing = {"on": True, "failed": 0}

    def alloc(buft: int, size: int) -> int | None:
        on_projector_thread = threading.current_thread().name.startswith("residency-projector")
        if failing["on"] and on_projector_thread and size > 4096:
            failing["failed"] += 1
            return None
        return real(buft, size)

    monkeypatch.setattr(_ggml, "buft_alloc_buffer", alloc)
    res.release()
    res.restore()  # the model's weights: no failure here
    engine.vision.forget_encoded()
    image = Run(engine, "image", messages=(ask(RED),), max_tokens=8)
    text = Run(engine, "text", messages=TEXT, max_tokens=8)
    while engine.active:
        engine.step()
    assert failing["failed"] >= 1
    assert isinstance(image.live.error, OutOfDeviceMemoryError), image.live.error
    assert text.live.error is None
    assert text.logprobs == text_before.logprobs and text.text == text_before.text
    # the projector stayed released: its bytes are no longer counted
    assert res.resident_bytes == res.weight_bytes - res.projector_bytes
    failing["on"] = False
    image_after = alone(engine, messages=(ask(RED),), max_tokens=8)
    assert image_after.live.error is None
    assert image_after.logprobs == image_before.logprobs and image_after.text == image_before.text
    assert res.resident_bytes == res.weight_bytes
