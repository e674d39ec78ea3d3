"""Run by tests/test_clients.py and bench/clients.py inside the client environment (tests/clients_env.py), never
imported by moekit: what transformers 4.57 and llama.cpp's converter make of a native export.

    python clients_check.py tf4 JOBS.json      # each job {dir, ids, out}: load with transformers 4.x, save logits
    python clients_check.py gguf LLAMA_CPP JOBS.json  # each job {dir, out}: convert_hf_to_gguf.py --outtype f32,
                                                      # then compare the GGUF's tensors with the HF ones

Prints one JSON line per job. The GGUF comparison maps the HF names itself (llama.cpp's tensor names, experts
stacked (E, ...), Llama's q/k rows permuted for its rope): it does not trust the converter's own mapping.
"""
from __future__ import annotations

import json
import re
import sys
import traceback
from pathlib import Path


def tf4(jobs: list[dict]) -> None:
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    for job in jobs:
        res = {"dir": job["dir"], "version": tf.__version__}
        try:
            model, info = tf.AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32,
                                                                  output_loading_info=True)
            res.update({"class": type(model).__name__, **{k: sorted(map(str, v)) for k, v in info.items()}})
            tok = tf.AutoTokenizer.from_pretrained(job["dir"]) if Path(job["dir"], "tokenizer.json").is_file() else None
            res["tokenizer"] = None if tok is None else type(tok).__name__
            if tok is not None and job.get("text"):
                res["text_ids"] = tok(job["text"])["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor(job["ids"])).logits
            torch.save(logits, job["out"])
        except Exception as e:  # reported, not raised: the caller asserts on it
            res["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------ llama.cpp

RENAMES = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", r"blk.\1.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", r"blk.\1.attn_k_norm.weight"),
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", r"blk.\1.ffn_gate_inp_shexp.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
]
CLASSIC = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def rope_permute(w, n_head: int):
    """llama.cpp's LlamaModel.permute: q/k rows from HF's rotate-half order to llama.cpp's interleaved one."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_gguf(hf: dict, config: dict) -> dict:
    """The GGUF tensors (numpy, PyTorch dim order) an HF checkpoint should convert to."""
    import numpy as np

    out, experts = {}, {}
    llama = config["model_type"] == "mixtral"  # llama.cpp's Llama architecture: q/k permuted
    for name, t in hf.items():
        if m := CLASSIC.fullmatch(name):
            experts.setdefault((int(m[1]), PROJ[m[3]]), {})[int(m[2])] = t
            continue
        if m := FUSED.fullmatch(name):
            if m[2] == "down_proj":
                out[f"blk.{m[1]}.ffn_down_exps.weight"] = t
            else:
                half = t.shape[1] // 2
                out[f"blk.{m[1]}.ffn_gate_exps.weight"], out[f"blk.{m[1]}.ffn_up_exps.weight"] = t[:, :half], t[:, half:]
            continue
        new = next((re.sub(p, r, name) for p, r in RENAMES if re.fullmatch(p, name)), None)
        if new is None:
            out[f"UNMAPPED {name}"] = t
            continue
        if llama and re.search(r"attn_[qk]\.", new):
            heads = config["num_attention_heads"] if ".attn_q." in new else config["num_key_value_heads"]
            t = rope_permute(t, heads)
        out[new] = t
    for (layer, proj), by_e in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def convert(llama_cpp: Path, folder: str, outfile: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py, in this process, f32. Its BPE pre-tokenizer check knows released
    tokenizers only (by the hash of one text's ids); a tokenizer it does not know (a test's) is marked "default"
    instead of refused. Nothing else of the converter is changed."""
    sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
    import convert_hf_to_gguf as conv
    from conversion import base

    original = base.TextModel.get_vocab_base_pre
    if not getattr(original, "moekit_test", False):
        def known_or_default(self, tokenizer):
            try:
                return original(self, tokenizer)
            except NotImplementedError:
                return "default"

        known_or_default.moekit_test = True
        base.TextModel.get_vocab_base_pre = known_or_default
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", "f32", "--outfile", outfile]
    try:
        conv.main()
    finally:
        sys.argv = argv


def gguf(llama_cpp: Path, jobs: list[dict]) -> None:
    import logging

    import numpy as np
    from safetensors.numpy import load_file

    logging.disable(logging.WARNING)
    for job in jobs:
        res = {"dir": job["dir"]}
        try:
            convert(llama_cpp, job["dir"], job["out"])
        except BaseException as e:  # noqa: BLE001  (the converter raises ValueError, SystemExit, ...)
            res["error"] = f"{type(e).__name__}: {e}".strip()[:500]
            res["trace"] = traceback.format_exc()[-1500:]
            print(json.dumps(res), flush=True)
            continue
        import gguf as gg

        reader = gg.GGUFReader(job["out"])
        got = {t.name: np.array(t.data) for t in reader.tensors}
        hf = {}
        for f in sorted(Path(job["dir"]).glob("*.safetensors")):
            hf.update(load_file(f))
        config = json.loads(Path(job["dir"], "config.json").read_text())
        want = expected_gguf(hf, config)
        arch = reader.fields["general.architecture"]
        res["arch"] = bytes(arch.parts[arch.data[0]]).decode()
        res["missing"] = sorted(set(want) - set(got))
        res["extra"] = sorted(set(got) - set(want))
        res["different"] = sorted(n for n in set(want) & set(got)
                                  if want[n].squeeze().shape != got[n].squeeze().shape
                                  or not np.array_equal(want[n].astype(np.float32).reshape(got[n].shape), got[n]))
        res["tensors"] = len(got)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "tf4":
        tf4(json.loads(Path(sys.argv[2]).read_text()))
    elif sys.argv[1] == "gguf":
        gguf(Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
