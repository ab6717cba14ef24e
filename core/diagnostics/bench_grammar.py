"""Grammar-constrained decoding, measured on one GGUF: the same prompt answered greedily (prefill,
then one token per ``llama_decode`` through the worker's ``Sampler``)

- without a grammar (plain decode);
- under a JSON schema's grammar applied by rejection (the worker's way, llama-server's
  ``common_sampler_sample``: check the sampled token, mask the vocabulary only when rejected);
- under the same grammar applied first (the whole vocabulary masked at every token).

Prints decode tok/s (prefill excluded), the sampling ms/token of each mode, the ratios, the
rejections, and whether both grammar modes gave the same answer (they must: greedy). ``--json``
prints JSON only.

    python -m timeshare.core.diagnostics.bench_grammar --model PATH [--n-gpu-layers -1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colours": {"type": "array", "items": {"type": "string"}},
        "friends": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "years": {"type": "integer"}},
                "required": ["name", "years"],
            },
        },
    },
    "required": ["name", "age", "colours", "friends"],
}
PROMPT = "Describe a cat and its friends as JSON, with a long list of colours."


def _run(
    llm: Any, tokens: list[int], grammar: str | None, grammar_first: bool, max_tokens: int
) -> dict[str, Any]:
    """Prefill, then sample and decode one token at a time through the worker's Sampler."""
    import llama_cpp

    from ..sampling import Sampling
    from ..worker.sampler import Sampler

    llm.reset()
    llm.eval(tokens)
    sampler = Sampler(llm, Sampling(grammar=grammar), grammar_first=grammar_first)
    vocab = llm._model.vocab
    out: list[int] = []
    sample_s = 0.0
    start = time.perf_counter()
    try:
        for _ in range(max_tokens):
            t = time.perf_counter()
            token = sampler.sample(llm.ctx, -1)
            sample_s += time.perf_counter() - t
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            out.append(token)
            llm.eval([token])
        end = time.perf_counter()
        rejections = sampler.rejections
    finally:
        sampler.close()
    n = max(1, len(out))
    return {
        "tokens": len(out),
        "decode_tok_s": n / max(1e-9, end - start),
        "sample_ms_per_token": 1000.0 * sample_s / n,
        "rejections": rejections,
        "text": bytes(llm.detokenize(out)).decode("utf-8", errors="replace"),
    }


def bench(model: str, n_gpu_layers: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    llm = llama_cpp.Llama(model, n_ctx=4096, n_gpu_layers=n_gpu_layers, verbose=False)
    try:
        template = llm.metadata.get("tokenizer.chat_template")
        if template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            fmt = Jinja2ChatFormatter(template=template, eos_token="", bos_token="")
            prompt = fmt(messages=[{"role": "user", "content": PROMPT}]).prompt
        else:
            prompt = f"User: {PROMPT}\nAssistant:"
        tokens = list(llm.tokenize(prompt.encode(), add_bos=True, special=True))
        grammar = json_schema_to_gbnf(json.dumps(SCHEMA))
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "rejection": [], "grammar_first": []}
        for _ in range(repeats):
            runs["plain"].append(_run(llm, tokens, None, False, max_tokens))
            runs["rejection"].append(_run(llm, tokens, grammar, False, max_tokens))
            runs["grammar_first"].append(_run(llm, tokens, grammar, True, max_tokens))
    finally:
        llm.close()

    def med(mode: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[mode]))

    report = {
        "model": model,
        "n_gpu_layers": n_gpu_layers,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "tokens": {m: runs[m][0]["tokens"] for m in runs},
        "decode_tok_s": {m: med(m, "decode_tok_s") for m in runs},
        "sample_ms_per_token": {m: med(m, "sample_ms_per_token") for m in runs},
        "rejections": runs["rejection"][0]["rejections"],
        "same_greedy_json": runs["rejection"][0]["text"] == runs["grammar_first"][0]["text"],
    }
    report["ratio_decode_rejection_vs_plain"] = (
        report["decode_tok_s"]["rejection"] / report["decode_tok_s"]["plain"]
    )
    report["ratio_decode_grammar_first_vs_plain"] = (
        report["decode_tok_s"]["grammar_first"] / report["decode_tok_s"]["plain"]
    )
    report["ratio_sample_ms_grammar_first_vs_rejection"] = (
        report["sample_ms_per_token"]["grammar_first"] / report["sample_ms_per_token"]["rejection"]
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_grammar", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF (default: the SmolLM2 demo model)")
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from ..config import demo

        model = str(demo.smollm2_path())
    report = bench(model, args.n_gpu_layers, args.max_tokens, args.repeats)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"model {model} (n_gpu_layers {args.n_gpu_layers}), "
        f"{args.max_tokens} tokens max, median of {args.repeats}"
    )
    for mode in ("plain", "rejection", "grammar_first"):
        print(
            f"  {mode:14s} {report['decode_tok_s'][mode]:8.1f} tok/s  "
            f"sampling {report['sample_ms_per_token'][mode]:7.3f} ms/token  ({report['tokens'][mode]} tokens)"
        )
    print(f"  decode with the grammar by rejection: {report['ratio_decode_rejection_vs_plain']:.3f} x plain")
    print(
        f"  decode with the grammar first:        {report['ratio_decode_grammar_first_vs_plain']:.3f} x plain"
    )
    print(
        "  sampling ms/token, grammar first / by rejection: "
        f"{report['ratio_sample_ms_grammar_first_vs_rejection']:.2f}"
        f" ({report['rejections']} rejections); same greedy JSON: {report['same_greedy_json']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
