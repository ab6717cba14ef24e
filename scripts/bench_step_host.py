"""Host time per decode step of the batch (issue 24): the Python around ``llama_decode``.

Usage (the CPU build is enough; a GPU build measures the same thing):

    .venv/bin/python scripts/bench_step_host.py [--model PATH] [--streams 8] [--tokens 64] [--rounds 3]
        [--n-ctx 512] [--flash-attn]

Loads the model with ``parallel = --streams`` and answers ``--streams`` greedy requests together,
stepping the batch two ways, alternately, in one run:

- ``before``: the step as it was (one ctypes write per field and token into a ``llama_batch_init``
  batch, each sequence's token from its llama_sampler chain: ``Sampler.sample``);
- ``after``: ``Decoder.step`` (numpy slices of the batch, one argmax over the plain greedy rows).

Each step's host time is its wall time less the time spent inside ``llama_decode`` and the
``llama_synchronize`` right after it (the compute may still run when llama_decode returns: the
first read of the logits would wait for it). Prints, as JSON, the median host ms per decode-only
step and per prefill step for both, their ratio (after / before), and whether both gave the same
answers (they must: greedy, bit for bit). The loop's own per-step work (the queue, the pipe) is
not in it. The "before" step reads the Decoder's internals: it is the old code, kept here only to
be measured against."""

from __future__ import annotations

# isort: off
import llama_cpp
# isort: on

import argparse
import json
import statistics
import sys
import time
from typing import Any

from timeshare.core.config import demo
from timeshare.core.config.schema import ModelConfig
from timeshare.core.sampling import Sampling
from timeshare.core.wire.protocol import Generate
from timeshare.core.worker import decode
from timeshare.core.worker.decode import Decoder, Live
from timeshare.core.worker.engine import Engine

PROMPTS = [
    "The three primary colours are",
    "Count from one to fifty: one, two, three,",
    "Les capitales européennes les plus connues sont",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The recipe for a simple bread needs flour,",
    "In 1969 the first people to walk on the Moon",
    "A list of prime numbers: 2, 3, 5, 7,",
]


class LegacyStep:
    """The step as it was before (git history: core/worker/decode.py), for comparison only."""

    def __init__(self, decoder: Decoder) -> None:
        self.d = decoder
        self.batch = llama_cpp.llama_batch_init(decoder.n_batch, 0, 1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)

    def _put(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        batch = self.batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = 1 if logits else 0

    def step(self) -> list[Live]:
        d = self.d
        if not d.live:
            return []
        n = 0
        outputs: list[tuple[Live, int]] = []
        taken: list[tuple[Live, int, bool]] = []
        for live in d.live:
            live.batch_size = max(live.batch_size, len(d.live))
            if live.token >= 0:
                self._put(n, live.token, len(live.ids), live.seq_id, True)
                outputs.append((live, n))
                taken.append((live, 1, False))
                n += 1
        for live in d.live:
            budget = d.n_batch - n
            if budget <= 0:
                break
            if not live.pending:
                continue
            k = min(budget, len(live.pending))
            last = k == len(live.pending)
            base = len(live.ids)
            for j in range(k):
                self._put(n, live.pending[j], base + j, live.seq_id, last and j == k - 1)
                n += 1
            if last:
                outputs.append((live, n - 1))
            taken.append((live, k, True))
        if n == 0:
            return []
        self.batch.n_tokens = n
        d.set_threads(prefill=any(prompt for _l, _k, prompt in taken))
        rc = int(llama_cpp.llama_decode(d.llm.ctx, self.batch))
        d.decodes += 1
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        for live, k, prompt in taken:
            if prompt:
                live.ids.extend(live.pending[:k])
                del live.pending[:k]
                live.evaluated += k
            else:
                live.ids.append(live.token)
                live.token = -1
        ctx = d.llm.ctx
        finished: list[Live] = []
        for live, row in outputs:
            if d.accept(live, live.sampler.sample(ctx, row)):
                finished.append(live)
        return finished


def one_round(engine: Engine, streams: int, tokens: int, legacy: LegacyStep | None) -> dict[str, Any]:
    inside = [0.0]
    real = llama_cpp.llama_decode

    def timed(ctx: Any, batch: Any) -> int:
        t = time.perf_counter()
        try:
            rc = int(real(ctx, batch))
            llama_cpp.llama_synchronize(ctx)  # the compute is done: what is left is the host's
            return rc
        finally:
            inside[0] += time.perf_counter() - t

    texts: list[list[str]] = []
    for i in range(streams):
        out: list[str] = []
        texts.append(out)
        req = Generate(
            req=f"r{i}",
            prompt=PROMPTS[i % len(PROMPTS)] + f" ({i})",
            sampling=Sampling(max_tokens=tokens, temperature=0.0),
            cache_prompt=False,
        )
        engine.start(engine.prepare(req), out.append)
    decoder = engine._decoder
    prefill: list[float] = []
    steps: list[float] = []
    decode.llama_cpp.llama_decode = timed  # type: ignore[attr-defined]
    try:
        while decoder.live:
            was_prefill = any(live.pending for live in decoder.live)
            inside[0] = 0.0
            t = time.perf_counter()
            done = legacy.step() if legacy is not None else decoder.step()
            host = (time.perf_counter() - t - inside[0]) * 1000.0
            for live in done:
                engine._leave(live)
            (prefill if was_prefill else steps).append(host)
    finally:
        decode.llama_cpp.llama_decode = real  # type: ignore[attr-defined]
    return {
        "decode_step_host_ms": steps,
        "prefill_step_host_ms": prefill,
        "texts": ["".join(t) for t in texts],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the SmolLM2 demo model)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true")
    args = ap.parse_args()
    path = args.model or str(demo.smollm2_path())
    config = ModelConfig(
        id="m", path=path, n_ctx=args.n_ctx, parallel=args.streams, flash_attn=args.flash_attn
    )
    engine = Engine.load(config)
    legacy = LegacyStep(engine._decoder)
    got: dict[str, dict[str, list[float]]] = {"before": {"d": [], "p": []}, "after": {"d": [], "p": []}}
    answers: dict[str, list[str]] = {}
    try:
        for _ in range(args.rounds):
            for name in ("before", "after"):
                r = one_round(engine, args.streams, args.tokens, legacy if name == "before" else None)
                got[name]["d"] += r["decode_step_host_ms"]
                got[name]["p"] += r["prefill_step_host_ms"]
                if answers.setdefault(name, r["texts"]) != r["texts"]:
                    print(f"{name}: answers differ between rounds", file=sys.stderr)
                    return 1
    finally:
        legacy.close()
        engine.close()
    med = {name: {k: statistics.median(v) for k, v in g.items() if v} for name, g in got.items()}
    report = {
        "model": path,
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "before": {"decode_step_host_ms": med["before"]["d"], "prefill_step_host_ms": med["before"].get("p")},
        "after": {"decode_step_host_ms": med["after"]["d"], "prefill_step_host_ms": med["after"].get("p")},
        "decode_step_ratio": med["after"]["d"] / med["before"]["d"],
        "prefill_step_ratio": (med["after"]["p"] / med["before"]["p"]) if "p" in med["after"] else None,
        "same_answers": answers["before"] == answers["after"],
    }
    print(json.dumps(report))
    return 0 if report["same_answers"] else 1


if __name__ == "__main__":
    sys.exit(main())
