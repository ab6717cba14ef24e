"""The engine: one loaded GGUF model and its conversations, driven by the worker's loop thread.

Nothing here is thread-safe on purpose: the worker's loop thread is the only caller. Generation
uses llama-cpp-python's own ``create_completion(..., stream=True)`` so that a completion at
temperature 0 equals what a plain ``Llama(path, n_ctx=...)`` produces: the context is built with
the library's defaults (only n_ctx, n_gpu_layers, use_mmap and verbose differ, none of which change
numerics) and completion-mode prompts start from an empty KV cache. The caller's ``before_step``
hook runs before every resume of the generator (the generator only decodes when resumed): that is
where the worker drains its queue (cancel, yield) and makes sure the weights are resident.

Conversations: the live one sits in the context and continues by llama-cpp-python's prefix
matching; the others are kept as host snapshots of the context state (``llama_state_get_data``)
in an LRU of ``n_seq`` entries, and written to disk (``kv_dir``) when the worker stops. So
switching conversations, or stopping and restarting the worker, costs no re-prefill.

Chat formats: the GGUF's Jinja chat template (``chat_format == "template"``), or for models without
one (e.g. the Gemma-3-270M base model) the fallback format below (``"fallback"``):

    <system text>\\n\\n            (only when there is a system message)
    User: <text>\\n
    Assistant: <text>\\n
    ...
    User: <last text>\\n
    Assistant:

with stop strings ``"\\nUser:"``, ``"\\nAssistant:"`` and ``"\\n\\n\\n"``, so a base model's answer ends
where it would start the next turn.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import llama_chat_format

from ..config.schema import ModelConfig
from ..errors import CancelledError, ModelFileError, PromptTooLongError
from ..modelfile import check_model_file
from ..residency import check_gguf
from .protocol import ChatMessage, FinishReason, Generate

log = logging.getLogger(__name__)

FALLBACK_STOP = ("\nUser:", "\nAssistant:", "\n\n\n")
_KV_MAGIC = b"TSKV1\n"


@dataclass(frozen=True)
class EngineInfo:
    n_ctx: int
    n_vocab: int
    chat_format: str  # "template" | "fallback"


@dataclass(frozen=True)
class GenerationOutcome:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_evaluated: int  # tokens prefilled by this request
    text: str


@dataclass(frozen=True)
class KVSnapshot:
    """A conversation's context state in host memory."""

    n_tokens: int
    input_ids: tuple[int, ...]
    state: bytes


class Engine:
    """A loaded model. Build it with ``Engine.load``; call only from one thread."""

    def __init__(self, llm: Any, model: ModelConfig, formatter: Any | None) -> None:
        self.llm = llm
        self.model = model
        self._formatter = formatter  # Jinja2ChatFormatter, or None for the fallback format
        self.info = EngineInfo(
            n_ctx=int(llm.n_ctx()),
            n_vocab=int(llm.n_vocab()),
            chat_format="template" if formatter is not None else "fallback",
        )
        self.live: str | None = None  # conversation whose KV is in the context (None: scratch)
        self.kv_dir: Path | None = None  # where a stopped worker left conversations' KV (see save_kv)
        # While the weights are released the residency hides the context behind a guard; state
        # I/O (which touches only the KV cache) then goes through the context this returns.
        self.state_ctx: Callable[[], Any] | None = None
        self._saved: OrderedDict[str, KVSnapshot] = OrderedDict()
        self.prompt_tokens_evaluated = 0  # since start
        self._counting = False
        self._request_evaluated = 0
        self._samples = 0
        self._last_sample = -1
        self._wrap_llm()

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, model: ModelConfig, *, use_mmap: bool = True) -> Engine:
        """Load the GGUF. Raises ModelFileError with a sentence saying what to do."""
        check_model_file(model.path)
        check_gguf(model.path)  # truncation is caught before llama.cpp sees the file
        try:
            llm = llama_cpp.Llama(
                model_path=model.path,
                n_ctx=model.n_ctx,
                n_gpu_layers=model.n_gpu_layers,
                use_mmap=use_mmap,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            log.error("llama.cpp failed to load %s: %s", model.path, exc)
            # check_gguf proved the header and the tensor data whole: llama.cpp refused it otherwise
            raise ModelFileError(
                f"model file {model.path} cannot be loaded: llama.cpp could not load it "
                "(unsupported architecture or damaged file); see the worker log"
            ) from None
        formatter = None
        want = model.chat_format
        template = model.chat_template or llm.metadata.get("tokenizer.chat_template")
        if want == "template" and not template:
            log.warning("%s has no chat template; using the fallback format", model.id)
        if template and want != "fallback":
            eos_id = llm.token_eos()
            bos_id = llm.token_bos()
            formatter = llama_chat_format.Jinja2ChatFormatter(
                template=template,
                eos_token=llm._model.token_get_text(eos_id) if eos_id != -1 else "",
                bos_token=llm._model.token_get_text(bos_id) if bos_id != -1 else "",
                stop_token_ids=[eos_id],
            )
        engine = cls(llm, model, formatter)
        log.info(
            "loaded %s: n_ctx=%d n_vocab=%d chat=%s",
            model.id,
            engine.info.n_ctx,
            engine.info.n_vocab,
            engine.info.chat_format,
        )
        return engine

    def _wrap_llm(self) -> None:
        """Count prefilled tokens and sampled tokens (instance attributes shadow the methods that
        ``Llama.generate`` calls through ``self``)."""
        llm = self.llm
        orig_eval = llm.eval
        orig_sample = llm.sample

        def counting_eval(tokens: Sequence[int]) -> None:
            if self._counting:
                self._request_evaluated += len(tokens)
            orig_eval(tokens)

        def counting_sample(*args: Any, **kwargs: Any) -> int:
            self._counting = False  # everything after the first sample is generation, not prefill
            token = int(orig_sample(*args, **kwargs))
            self._samples += 1
            self._last_sample = token
            return token

        llm.eval = counting_eval
        llm.sample = counting_sample

    # ---- conversations ----------------------------------------------------------------------

    def _state_ctx(self) -> Any:
        """The llama_context pointer for state I/O (see ``state_ctx``)."""
        return self.state_ctx() if self.state_ctx is not None else self.llm.ctx

    def _snapshot(self) -> KVSnapshot:
        ctx = self._state_ctx()
        size = int(llama_cpp.llama_state_get_size(ctx))
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_cpp.llama_state_get_data(ctx, buf, size))
        n_tokens = int(self.llm.n_tokens)
        return KVSnapshot(n_tokens, tuple(int(t) for t in self.llm.input_ids[:n_tokens]), bytes(buf)[:n])

    def _load_snapshot(self, snap: KVSnapshot) -> None:
        ctx = self._state_ctx()
        buf = (ctypes.c_uint8 * len(snap.state)).from_buffer_copy(snap.state)
        if int(llama_cpp.llama_state_set_data(ctx, buf, len(snap.state))) != len(snap.state):
            raise RuntimeError("llama.cpp refused a KV snapshot")
        self.llm.input_ids[: snap.n_tokens] = snap.input_ids
        self.llm.n_tokens = snap.n_tokens
        self.llm._requires_eval = True

    def park(self) -> None:
        """Move the live conversation into the host LRU (before the context is freed)."""
        self._park_live()

    def _park_live(self) -> None:
        """Keep the live conversation's KV as a host snapshot before the context is reused."""
        if self.live is None:
            return
        self._saved[self.live] = self._snapshot()
        self._saved.move_to_end(self.live)
        self.live = None
        self._trim(self.model.n_seq)

    def _trim(self, keep: int) -> None:
        """LRU beyond ``n_seq``: the least recently used snapshots go to ``kv_dir`` (so they still
        come back without a re-prefill), or are dropped when there is no kv_dir."""
        while len(self._saved) > max(keep, 0):
            evicted, snap = self._saved.popitem(last=False)
            where = "dropped"
            if self.kv_dir is not None:
                try:
                    self._write_snapshot(self.kv_dir, evicted, snap, self._identity())
                    where = f"moved to {self.kv_dir}"
                except OSError as exc:
                    log.warning("could not write the KV of %s to %s: %s", evicted, self.kv_dir, exc)
            log.info("conversation %s left the KV cache (n_seq=%d): %s", evicted, self.model.n_seq, where)

    def _switch_to(self, conversation: str | None, *, fresh: bool) -> None:
        if conversation is not None and conversation == self.live:
            return
        self._park_live()
        if conversation is not None:
            if conversation not in self._saved and self.kv_dir is not None:
                self.load_kv(self.kv_dir, conversation)
            self._trim(self.model.n_seq - 1 if conversation not in self._saved else self.model.n_seq)
            snap = self._saved.pop(conversation, None)
            if snap is not None:
                self._load_snapshot(snap)
                log.debug("conversation %s restored from host (%d tokens)", conversation, snap.n_tokens)
            self.live = conversation
        if fresh:
            self.llm.reset()

    @property
    def conversations(self) -> tuple[str, ...]:
        live = (self.live,) if self.live is not None else ()
        return live + tuple(reversed(self._saved))

    # ---- KV on disk (stop / start) ----------------------------------------------------------

    def _identity(self) -> dict[str, object]:
        st = os.stat(self.model.path)
        return {
            "path": os.path.abspath(self.model.path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "n_ctx": self.info.n_ctx,
        }

    def _kv_file(self, kv_dir: Path, conversation: str) -> Path:
        digest = hashlib.sha256(conversation.encode()).hexdigest()[:32]
        return kv_dir / f"{self.model.id}-{digest}.kv"

    def save_kv(self, kv_dir: Path) -> int:
        """Write every conversation's KV snapshot to ``kv_dir`` (atomic per file). Returns how many."""
        try:
            self._park_live()
        except Exception:  # the others are still worth saving
            log.exception("could not snapshot the live conversation %s", self.live)
            self.live = None
        ident = self._identity()
        count = 0
        for conversation, snap in self._saved.items():
            self._write_snapshot(kv_dir, conversation, snap, ident)
            count += 1
        log.info("saved the KV of %d conversation(s) to %s", count, kv_dir)
        return count

    def _write_snapshot(
        self, kv_dir: Path, conversation: str, snap: KVSnapshot, ident: dict[str, object]
    ) -> None:
        kv_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        header = json.dumps(
            {"model": self.model.id, "conversation": conversation, "n_tokens": snap.n_tokens, "file": ident}
        ).encode()
        target = self._kv_file(kv_dir, conversation)
        tmp = target.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(_KV_MAGIC + struct.pack(">I", len(header)) + header)
            f.write(struct.pack(f"<{snap.n_tokens}i", *snap.input_ids))
            f.write(snap.state)
        os.replace(tmp, target)

    def load_kv(self, kv_dir: Path, conversation: str) -> bool:
        """Bring a conversation saved by ``save_kv`` back into the host LRU (and delete the file).
        A file from another model file or context size is ignored and removed."""
        path = self._kv_file(kv_dir, conversation)
        if not path.is_file():
            return False
        try:
            data = path.read_bytes()
            if not data.startswith(_KV_MAGIC):
                raise ValueError("bad magic")
            off = len(_KV_MAGIC)
            (hlen,) = struct.unpack_from(">I", data, off)
            off += 4
            header = json.loads(data[off : off + hlen])
            off += hlen
            if header.get("conversation") != conversation or header.get("file") != self._identity():
                raise ValueError("saved for another model file or context size")
            n = int(header["n_tokens"])
            ids = struct.unpack_from(f"<{n}i", data, off)
            off += 4 * n
            snap = KVSnapshot(n, tuple(ids), data[off:])
        except (ValueError, KeyError, struct.error) as exc:
            log.warning("ignoring saved KV %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return False
        path.unlink(missing_ok=True)
        self._saved[conversation] = snap
        self._saved.move_to_end(conversation)
        log.info("conversation %s: KV loaded from disk (%d tokens)", conversation, n)
        return True

    # ---- prompts ----------------------------------------------------------------------------

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> tuple[list[int], list[str], Any]:
        """Tokens, extra stop strings and a stopping criterion for a chat request."""
        llm = self.llm
        if self._formatter is not None:
            result = self._formatter(messages=[{"role": m.role, "content": m.content} for m in messages])
            tokens = llm.tokenize(
                result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True
            )
            stop = (
                list(result.stop) if isinstance(result.stop, list) else [result.stop] if result.stop else []
            )
            return tokens, stop, result.stopping_criteria
        return (
            llm.tokenize(fallback_prompt(messages).encode("utf-8"), add_bos=True, special=False),
            list(FALLBACK_STOP),
            None,
        )

    def _too_long(self, n: int) -> PromptTooLongError:
        return PromptTooLongError(
            f"the prompt is {n} tokens but {self.model.display_name} holds {self.info.n_ctx} tokens "
            f"of context (the answer needs room too): shorten the prompt or raise n_ctx for this model"
        )

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        req: Generate,
        emit: Callable[[str], None],
        before_step: Callable[[], None] = lambda: None,
    ) -> GenerationOutcome:
        """Run one request. ``before_step`` runs before every decode step and may raise
        CancelledError to stop (finish_reason "cancelled"). Raises PromptTooLongError without
        touching the KV cache of any conversation."""
        llm = self.llm
        stop = list(req.stop)
        criteria = None
        prompt: str | list[int]
        if req.messages is not None:
            prompt, extra_stop, criteria = self._chat_prompt(req.messages)
            stop += extra_stop
            n_prompt = len(prompt)
        else:
            assert req.prompt is not None
            prompt = req.prompt
            n_prompt = (
                len(llm.tokenize(req.prompt.encode("utf-8"), add_bos=True, special=True)) if req.prompt else 1
            )
        if n_prompt >= self.info.n_ctx:
            raise self._too_long(n_prompt)
        before_step()  # residency first: switching conversations touches the context
        # A request without a conversation starts from an empty KV cache, exactly like a fresh
        # Llama, so the same request gives the same answer bit for bit (a prefix reused from
        # another request was computed in other batches and can change the last bits of the
        # logits). A conversation reuses the longest common prefix of what its KV holds.
        self._switch_to(req.conversation, fresh=req.conversation is None)
        self._request_evaluated = 0
        self._samples = 0
        self._last_sample = -1
        self._counting = True
        kwargs: dict[str, Any] = {
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stop": stop,
            "stream": True,
            "seed": req.seed,
        }
        if criteria is not None:
            kwargs["stopping_criteria"] = criteria
        stream: Iterator[dict[str, Any]] = llm.create_completion(prompt, **kwargs)
        finish: FinishReason = "length"
        pieces: list[str] = []
        try:
            while True:
                before_step()
                try:
                    chunk = next(stream)
                except StopIteration:
                    break
                choice = chunk["choices"][0]
                if choice["text"]:
                    pieces.append(choice["text"])
                    emit(choice["text"])
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        except CancelledError:
            finish = "cancelled"
        except ValueError as exc:
            match = re.search(r"Requested tokens \((\d+)\) exceed context window", str(exc))
            if match:
                raise self._too_long(int(match.group(1))) from None
            raise
        finally:
            self._counting = False
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            self.prompt_tokens_evaluated += self._request_evaluated
        completion = self._samples
        if completion and llama_cpp.llama_vocab_is_eog(llm._model.vocab, self._last_sample):
            completion -= 1
        return GenerationOutcome(finish, n_prompt, completion, self._request_evaluated, "".join(pieces))

    def close(self) -> None:
        self._saved.clear()
        self.llm.close()


def fallback_prompt(messages: Sequence[ChatMessage]) -> str:
    """The plain chat format for models without a chat template (see the module docstring)."""
    parts: list[str] = []
    system = [m.content for m in messages if m.role == "system"]
    if system:
        parts.append("\n".join(system).strip() + "\n\n")
    for m in messages:
        if m.role == "user":
            parts.append(f"User: {m.content.strip()}\n")
        elif m.role == "assistant":
            parts.append(f"Assistant: {m.content.strip()}\n")
    parts.append("Assistant:")
    return "".join(parts)
