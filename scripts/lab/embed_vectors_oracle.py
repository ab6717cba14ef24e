"""Whose embeddings are right when Timeshare's and llama-server's differ (issue 45).

`timeshare bench embed` reports the least cosine between the two servers' vectors; this says
which of them departs from the oracle: plain llama-cpp-python embedding each input alone
(``Llama(embedding=True, pooling_type=MEAN).embed``, one input per call, nothing else in its
context). It sends the bench's own inputs (``bench_embed.inputs``) to llama-server
``--embeddings --pooling mean`` with ``-np 1`` and ``-np N``, and to ``timeshare serve`` with
``parallel N``, and prints each input's token count and its cosine with the oracle per system.
Run: .venv/bin/python scripts/lab/embed_vectors_oracle.py LLAMA_SERVER [COUNT [N]]
(default 16 inputs, N 4; the model: the SmolLM2 demo model; figures: docs/PERFORMANCE.md).
"""

import sys
import tempfile
from pathlib import Path

import llama_cpp  # first: worker import order
import numpy as np
from timeshare.core.config import demo
from timeshare.core.diagnostics.bench_api_procs import LlamaServer, Serve
from timeshare.core.diagnostics.bench_embed import inputs, post_embeddings
from timeshare.core.worker.threads import cpu_threads


def main() -> None:
    binary = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    model = str(demo.smollm2_path())
    texts = inputs(count, 8)
    llm = llama_cpp.Llama(
        model, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_ctx=512, verbose=False
    )
    oracle = np.array([llm.embed(t, normalize=True) for t in texts], dtype=np.float64)
    print("tokens", [len(llm.tokenize(t.encode())) for t in texts])
    llm.close()

    def cosines(vectors: list[list[float]]) -> list[float]:
        v = np.asarray(vectors, dtype=np.float64)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        return [round(float(c), 6) for c in np.einsum("ij,ij->i", v, oracle)]

    with tempfile.TemporaryDirectory(prefix="embed-oracle-") as tmp:
        for slots in sorted({1, n}):
            log = Path(tmp) / f"llama-server-{slots}.log"
            extra = ("--embeddings", "--pooling", "mean")
            server = LlamaServer(
                binary, model, 2048 * slots, False, log, parallel=slots, extra=extra, threads=cpu_threads()
            )
            try:
                server.wait_healthy()
                print(f"llama-server -np {slots}", cosines(post_embeddings(server.port, texts)[1]))
            finally:
                server.stop()
        serve = Serve(Path(tmp) / "ts", ["m"], [model], 2048, False, parallel=n)
        try:
            serve.wait_ready()
            print(f"timeshare parallel {n}", cosines(post_embeddings(serve.port, texts)[1]))
        finally:
            serve.close()


if __name__ == "__main__":
    main()
