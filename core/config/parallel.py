"""How many sequences a model decodes together when ``models[].parallel`` is 0 (auto).

Plain numbers (no llama objects), so the app process (the "Get model…" dialog's KV estimate) and
the worker (``worker.device.default_parallel``, which asks llama.cpp whether the build has a GPU)
resolve the setting the same way.
"""

from __future__ import annotations

#: on a GPU a step of four sequences costs little more than a step of one (the weights are read
#: once per step); on a CPU a step costs about its tokens' compute, so two streams batched were no
#: faster than one at a time (docs/PERFORMANCE.md, continuous batching: SmolLM2 0.84-1.16x in 3
#: runs, Gemma-3 0.63x) for twice the KV: one at a time is the CPU default; a number in the setting
#: still batches (with the solo answers: see engine.batch_invariant)
GPU_PARALLEL = 4
CPU_PARALLEL = 1


def auto_parallel(gpu: bool) -> int:
    """``parallel`` for a model whose setting is 0 (auto) on a build with (``gpu``) or without a GPU."""
    return GPU_PARALLEL if gpu else CPU_PARALLEL
