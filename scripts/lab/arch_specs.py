"""Find an architecture's tensors and their shapes from llama.cpp's loader errors (lab tool; issue 38).

usage: arch_specs.py TOKENIZER.gguf ARCH '{"{arch}.block_count": 2, ...}'
Writes a model with the tensors found so far, loads it, reads "tensor X not found" or "X has
wrong shape; expected ..." from the log, and goes on until it loads; prints the tensors as JSON
(the layouts in tests/data/arch_specs.json came from it)."""

import ctypes
import json
import re
import sys

import gguf
import llama_cpp
import numpy as np

LOG = []


@llama_cpp.llama_log_callback
def _cb(level, text, user):
    LOG.append(text.decode(errors="replace"))


llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))

voc = gguf.GGUFReader(sys.argv[1])
f = voc.fields
NV = 1024
toks = f["tokenizer.ggml.tokens"].contents()[:NV]
keep = set(toks)
merges = [
    m
    for m in f["tokenizer.ggml.merges"].contents()
    if (lambda a: len(a) == 2 and a[0] in keep and a[1] in keep and a[0] + a[1] in keep)(m.split(" "))
]


def write(path, arch, kv, tensors):
    w = gguf.GGUFWriter(path, arch)
    for k, v in kv.items():
        key = k.replace("{arch}", arch)
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, list):
            if all(isinstance(x, bool) for x in v):
                w.add_array(key, v)
            else:
                w.add_array(key, v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    w.add_token_list(toks)
    w.add_token_types(f["tokenizer.ggml.token_type"].contents()[:NV])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    for name, shape in tensors.items():
        w.add_tensor(name, (rng.standard_normal(tuple(reversed(shape))) * 0.05).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def run(arch, kv):
    tensors = {}
    for _it in range(400):
        write("/tmp/arch_specs_probe.gguf", arch, kv, tensors)
        LOG.clear()
        try:
            llm = llama_cpp.Llama("/tmp/arch_specs_probe.gguf", n_ctx=64, verbose=True)
            llm.close()
            return tensors, None
        except Exception:
            text = "".join(LOG)
            m = re.search(r"tensor '([^']+)' not found", text)
            if m:
                tensors[m.group(1)] = [1]
                continue
            m = re.search(r"tensor '([^']+)' has wrong shape; expected ([\d, ]+), got", text)
            if m:
                shape = [int(x) for x in m.group(2).split(",")]
                while len(shape) > 1 and shape[-1] == 1:
                    shape.pop()
                tensors[m.group(1)] = shape
                continue
            return tensors, text[-3000:]
    return tensors, "too many"


if __name__ == "__main__":
    arch = sys.argv[2]
    kv = json.loads(sys.argv[3])
    t, err = run(arch, kv)
    print(json.dumps(t))
    if err:
        print("ERR", err)
