"""How often a quantised KV cache's greedy answers equal f16's on the demo models (issue 39).

Ten fixed prompts, 48 tokens at temperature 0, n_ctx 2048, one sequence, through plain
llama-cpp-python with the parameters the worker passes: f16 (no flash attention, the default),
f16 with flash attention, q8_0 and q4_0 (both with flash attention: llama.cpp needs it for a
quantised V). Prints the answers equal to f16's (and to f16 with flash attention) out of 10.
Run: .venv/bin/python scripts/lab/kv_cache_agreement.py (figures: docs/PERFORMANCE.md).
"""

import llama_cpp  # first: worker import order
from timeshare.core.config import demo
from timeshare.core.gguf.kvcache import KV_TYPES

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The three primary colours are",
    "Once upon a time, in a small village,",
    "Explain photosynthesis in one sentence.",
    "List five fruits:",
    "The meaning of life is",
    "In 1969, the first humans",
    "To make a cup of tea, you",
]
SYSTEMS = {
    "f16": {},
    "f16+fa": {"flash_attn": True},
    "q8_0": {"flash_attn": True, "type_k": KV_TYPES["q8_0"][2], "type_v": KV_TYPES["q8_0"][2]},
    "q4_0": {"flash_attn": True, "type_k": KV_TYPES["q4_0"][2], "type_v": KV_TYPES["q4_0"][2]},
}


def main() -> None:
    for name, path in (("smollm2", demo.smollm2_path()), ("gemma3", demo.gemma3_path())):
        answers = {}
        for label, kw in SYSTEMS.items():
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, verbose=False, **kw)
            answers[label] = [
                llm.create_completion(p, max_tokens=48, temperature=0.0)["choices"][0]["text"]
                for p in PROMPTS
            ]
            llm.close()
        same = {k: sum(a == b for a, b in zip(answers["f16"], v, strict=True)) for k, v in answers.items()}
        same_fa = {
            k: sum(a == b for a, b in zip(answers["f16+fa"], v, strict=True))
            for k in ("q8_0", "q4_0")
            for v in [answers[k]]
        }
        print(name, "equal to f16:", same, "equal to f16+fa:", same_fa, flush=True)


if __name__ == "__main__":
    main()
