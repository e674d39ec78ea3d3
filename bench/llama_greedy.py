"""Greedy tokens from llama.cpp (bench/clients.py runs it as a child process): the ctypes binding of the
llama-cpp-python sdist (llama_cpp/llama_cpp.py only, not its high-level package) over the libllama built from
the same tree.

    LLAMA_CPP_LIB_PATH=BUILD/bin python llama_greedy.py SDIST MODEL.gguf JOBS.json

JOBS: {"prompts": [[ids...], ...], "texts": [...], "new": 16}. Prints one JSON line: the greedy continuation of
each prompt (argmax of the logits, no stop token) and llama.cpp's own tokenization of each text.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import sys
import types
from pathlib import Path


def binding(sdist: Path):
    """llama_cpp.llama_cpp without llama_cpp/__init__.py (which imports the high-level API and its packages)."""
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(sdist / "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    spec = importlib.util.spec_from_file_location("llama_cpp.llama_cpp", sdist / "llama_cpp" / "llama_cpp.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llama_cpp.llama_cpp"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(sdist: Path, model_path: Path, jobs: dict) -> dict:
    ll = binding(sdist)
    quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)
    if not jobs.get("verbose"):
        ll.llama_log_set(quiet, None)
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(str(model_path).encode(), ll.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {model_path}")
    vocab = ll.llama_model_get_vocab(model)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    out = {"tokens": [], "tokenized": []}
    for prompt in jobs["prompts"]:
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch = 256, 256
        ctx = ll.llama_init_from_model(model, params)
        ids, new = list(prompt), []
        batch_ids = (ll.llama_token * len(ids))(*ids)
        for step in range(jobs["new"]):
            if ll.llama_decode(ctx, ll.llama_batch_get_one(batch_ids, len(batch_ids))) != 0:
                raise SystemExit("llama_decode failed")
            logits = ll.llama_get_logits_ith(ctx, -1)
            row = [logits[i] for i in range(n_vocab)]
            if any(x != x for x in row):
                new.append(-1)  # NaN logits (e.g. 0/0 in a gate): no token
                break
            tok = max(range(n_vocab), key=row.__getitem__)
            new.append(tok)
            batch_ids = (ll.llama_token * 1)(tok)
        out["tokens"].append(new)
        ll.llama_free(ctx)
    for text in jobs.get("texts", []):
        raw = text.encode()
        buf = (ll.llama_token * (len(raw) + 8))()
        n = ll.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
        out["tokenized"].append(list(buf[:n]))
    ll.llama_model_free(model)
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()))))
