"""A decoder layer bigger than memory: routing capture of DeepSeek-V3's width, in its published FP8 layout (or with
Kimi-K2-Thinking's INT4 experts: --format int4), on a 2-core, 24 GB machine, its MoE layer's experts read a few at a
time (`routes collect --experts-per-load`).

The checkpoint is generated, not downloaded: DeepSeek-V3's width (hidden 7168; MLA with q_lora 1536, kv_lora 512,
128 heads of 128 + 64 rotary, values 128; 256 routed experts of 2048 and one shared, top-8 in 8 groups of which 4;
vocab 129280, untied head) with 2 decoder layers, the first dense (18432, as DeepSeek-V3's first three are) and the
second MoE, in the Hub's layout: every projection F8_E4M3 with a float32 `weight_scale_inv` per 128×128 block
(quantization_config fp8, weight_block_size [128, 128]; kv_a_proj_with_mqa's 576 rows end in a partial block),
embeddings, norms and router in bfloat16, written tensor by tensor (random N(0, 1) FP8 values, scales 0.02 / √…).
--format int4: Kimi-K2-Thinking's layout instead (the same architecture; compressed-tensors pack-quantized, 4-bit
symmetric integers in groups of 32 columns with bf16 scales, on the routed experts only: `W_packed` int32 words,
`W_scale`, `W_shape`; attention, shared expert and dense MLP in bfloat16, as its config's ignore list says), random
words (every 4-bit value equally likely), scales 0.02 / √… / 4.6 (the spread of uniform values in [-8, 7]).
The one MoE layer's experts are 256 × 3 × 7168 × 2048 values: 22.5 GB in bfloat16, computed from the shapes, more
than this machine has; the whole model in bfloat16 would take about 27 GB. Texts: 3 languages × VERSES Bible verses
(SmolLM2's tokenizer; random weights, so the numbers say what the machinery costs, nothing about any routing).

Steps, each its own `moekit` process (wall and peak RSS from its final line), cached in OUT/results.json so an
interrupted run resumes:
  1. routes collect --stream on --dtype bfloat16: the experts' part size chosen by the memory available;
  2. the same with --experts-per-load 32 (other parts: are the decisions the same?);
  3. REAP's workflow: select reap --top 128 --groups 8 on step 1's trace (16 in each of the 8 groups of its
     group-limited routing), prune --keep (the checkpoint stays FP8), and the pruned checkpoint's routing captured
     the same way.

    .venv/bin/python bench/big_layer.py --out /work/big_layer --write BENCHMARKS.md
    .venv/bin/python bench/big_layer.py --format int4 --out /work/big_layer_int4 --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from big_moe import moekit, smollm2_tokenizer, texts  # noqa: E402  (bench/big_moe.py)
from report import cpu_name, resumable, write_section  # noqa: E402

# per format: the section's marks, the measured run's results.json (committed), the checkpoint's folder and layout
FORMATS = {
    "fp8": (("<!-- big_layer -->", "<!-- /big_layer -->"), "bench/results/big_layer/results.json",
            "deepseek-v3-2L-fp8", "in FP8", "in its published layout (FP8 projections with 128×128 block scales)"),
    "int4": (("<!-- big_layer_int4 -->", "<!-- /big_layer_int4 -->"), "bench/results/big_layer/results-int4.json",
             "deepseek-v3-2L-int4", "with Kimi-K2-Thinking's INT4 experts",
             "in Kimi-K2-Thinking's layout (routed experts compressed-tensors pack-quantized: 4-bit integers in "
             "groups of 32 with bf16 scales; everything else bf16)")}
WIDTH = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
             num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
             n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
             qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
             num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=4096,
             tie_word_embeddings=False, rms_norm_eps=1e-6)
SMALL = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=32, kv_lora_rank=64, q_lora_rank=96,
             qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32)  # --small: a smoke test's width
BLOCK = 128
GROUP = 32  # int4: columns per scale
INT4_CONFIG = {  # Kimi-K2-Thinking's quantization_config
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": GROUP, "dynamic": False, "actorder": None,
                                              "block_structure": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None}
VERSES = 8
PARTS = 32  # step 2's experts per load
KEEP = 128  # experts kept by REAP


def tensors() -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, stored in FP8) of every tensor of the Hub's layout, in its order."""
    w = WIDTH
    H, V, heads = w["hidden_size"], w["vocab_size"], w["num_attention_heads"]
    qk, rope = w["qk_nope_head_dim"] + w["qk_rope_head_dim"], w["qk_rope_head_dim"]
    out = [("model.embed_tokens.weight", (V, H), False)]
    for i in range(w["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), False), (p + "post_attention_layernorm.weight", (H,), False),
                (p + "self_attn.q_a_proj.weight", (w["q_lora_rank"], H), True),
                (p + "self_attn.q_a_layernorm.weight", (w["q_lora_rank"],), False),
                (p + "self_attn.q_b_proj.weight", (heads * qk, w["q_lora_rank"]), True),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (w["kv_lora_rank"] + rope, H), True),
                (p + "self_attn.kv_a_layernorm.weight", (w["kv_lora_rank"],), False),
                (p + "self_attn.kv_b_proj.weight",
                 (heads * (w["qk_nope_head_dim"] + w["v_head_dim"]), w["kv_lora_rank"]), True),
                (p + "self_attn.o_proj.weight", (H, heads * w["v_head_dim"]), True)]
        mlps = [("mlp", w["intermediate_size"])] if i < w["first_k_dense_replace"] else \
            [*((f"mlp.experts.{e}", w["moe_intermediate_size"]) for e in range(w["n_routed_experts"])),
             ("mlp.shared_experts", w["moe_intermediate_size"] * w["n_shared_experts"])]
        if i >= w["first_k_dense_replace"]:
            out += [(p + "mlp.gate.weight", (w["n_routed_experts"], H), False),
                    (p + "mlp.gate.e_score_correction_bias", (w["n_routed_experts"],), False)]
        for m, inter in mlps:
            out += [(p + f"{m}.gate_proj.weight", (inter, H), True), (p + f"{m}.up_proj.weight", (inter, H), True),
                    (p + f"{m}.down_proj.weight", (H, inter), True)]
    return out + [("model.norm.weight", (H,), False), ("lm_head.weight", (V, H), False)]


def planned(fmt: str):
    """(the tensors to write, {a scale's name: (its weight's fan-in, the spread of the weight's values)}, {a packed
    weight's `_shape`: the shape it holds})."""
    from moekit.checkpoint.writer import Planned

    plan, scales, shapes = [], {}, {}
    for name, shape, fp8 in tensors():
        if fmt == "int4" and ".mlp.experts." in name:
            plan += [Planned(name + "_packed", (shape[0], shape[1] // 8), torch.int32),
                     Planned(name + "_scale", (shape[0], shape[1] // GROUP), torch.bfloat16),
                     Planned(name + "_shape", (2,), torch.int64)]
            scales[name + "_scale"], shapes[name + "_shape"] = (shape[1], 4.6), shape
        elif fmt == "fp8" and fp8:
            plan += [Planned(name, shape, torch.float8_e4m3fn),
                     Planned(name + "_scale_inv", tuple(math.ceil(d / BLOCK) for d in shape), torch.float32)]
            scales[name + "_scale_inv"] = (shape[1], 1.0)
        else:
            plan.append(Planned(name, shape, torch.bfloat16))
    return plan, scales, shapes


def generate(folder: Path, fmt: str) -> Path:
    """The checkpoint (module docstring), written tensor by tensor with moekit's shard writer."""
    from transformers import DeepseekV3Config

    from moekit._fs import output
    from moekit.checkpoint.writer import ShardWriter

    if (folder / "config.json").is_file():
        return folder
    plan, scales, shapes = planned(fmt)
    with output(folder, overwrite=True) as tmp:
        writer = ShardWriter(tmp, plan)
        for n, p in enumerate(plan):
            g = torch.Generator().manual_seed(zlib.crc32(p.name.encode()))
            if p.name in scales:  # values of spread `spread` times 0.02 / sqrt(fan-in / 2048) / spread
                fan_in, spread = scales[p.name]
                t = torch.full(p.shape, 0.02 / math.sqrt(fan_in / 2048) / spread)
            elif p.name in shapes:
                t = torch.tensor(shapes[p.name])
            elif p.name.endswith("_packed"):  # every 4-bit value equally likely
                t = torch.randint(-2**31, 2**31 - 1, p.shape, generator=g, dtype=torch.int32)
            elif p.name.endswith(("norm.weight", "layernorm.weight")):
                t = torch.ones(p.shape)
            elif p.name.endswith("e_score_correction_bias"):
                t = torch.zeros(p.shape)
            else:
                t = torch.randn(p.shape, generator=g) * (1.0 if p.dtype == torch.float8_e4m3fn else 0.02)
            writer.write(p.name, t.to(p.dtype))
            if n % 200 == 0:
                print(f"{folder.name}: {n}/{len(plan)} tensors", flush=True)
        writer.close()
        cfg = DeepseekV3Config(**WIDTH)
        cfg.architectures = ["DeepseekV3ForCausalLM"]
        cfg.quantization_config = INT4_CONFIG if fmt == "int4" else {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
        cfg.save_pretrained(tmp)
        smollm2_tokenizer(tmp)
    return folder


def run(out: Path, fmt: str) -> dict:
    results, step = resumable(out)

    model = generate(out / FORMATS[fmt][2], fmt)
    files = texts(out / "texts", VERSES)
    results["bytes"] = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for name, extra in (("auto", []), ("parts", ["--experts-per-load", PARTS])):
        step(f"collect_{name}", lambda name=name, extra=extra: moekit(
            "routes", "collect", "--model", model, "--texts", *files, "--out", out / f"trace_{name}.npz",
            "--stream", "on", "--dtype", "bfloat16", "--overwrite", *extra))
    # REAP's workflow at this width: the top half of the experts by saliency, removed from the FP8 checkpoint
    step("select_reap", lambda: moekit("select", "reap", out / "trace_auto.npz", "--top", KEEP, "--groups",
                                       WIDTH["n_group"], "--out", out / "reap.json", "--overwrite"))
    step("prune_keep", lambda: moekit("prune", "--model", model, "--experts", out / "reap.json", "--keep", "--out",
                                      out / "pruned", "--overwrite"))
    results["pruned_bytes"] = sum(f.stat().st_size for f in (out / "pruned").glob("*.safetensors"))
    step("collect_pruned", lambda: moekit(
        "routes", "collect", "--model", out / "pruned", "--texts", *files, "--out", out / "trace_pruned.npz",
        "--stream", "on", "--dtype", "bfloat16", "--overwrite"))
    step("summary", lambda: summary(out, fmt))
    return results


def summary(out: Path, fmt: str) -> dict:
    """What the section reports beside the steps' walls and peaks, read from OUT's traces and checkpoints, with the
    machine they ran on: everything `section` needs, so that a committed results.json rebuilds it (--from)."""
    from moekit.checkpoint.dense import meta_model
    from moekit.routing.trace import RoutingTrace

    traces = {n: RoutingTrace.load(out / f"trace_{n}.npz") for n in ("auto", "parts", "pruned")}
    model, pruned = out / FORMATS[fmt][2], out / "pruned"
    return {
        "date": str(date.today()), "cpu": cpu_name(), "cores": os.cpu_count(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
        "pruned_bytes": sum(f.stat().st_size for f in pruned.glob("*.safetensors")),
        "pruned_quant_method": json.loads((pruned / "config.json").read_text())["quantization_config"]["quant_method"],
        "model_bf16_bytes": sum(p.numel() for p in meta_model(model).parameters()) * 2,
        "tokens": {n: t.num_tokens for n, t in traces.items()},
        "experts_per_load": {n: t.meta.get("experts_per_load") for n, t in traces.items()},
        "pruned_experts": int(traces["pruned"].num_experts.max()),
        "ids_equal": float((traces["auto"].ids == traces["parts"].ids).mean()),
    }


def section(results: dict, out: Path, fmt: str = "fp8") -> str:
    m, w = results["summary"], WIDTH
    mark, committed, _, title, layout = FORMATS[fmt]
    layer = 3 * w["n_routed_experts"] * w["hidden_size"] * w["moe_intermediate_size"] * 2
    rows = ["| step | wall (s) | tokens/s | peak RSS (GiB) | experts per load | note |", "|---|---|---|---|---|---|"]
    for name, note in (("auto", f"the MoE layer's experts: {layer / 2**30:.1f} GiB in bf16"),
                       ("parts", f"ids equal to the first row's: {m['ids_equal']:.4f} of (token, slot)s")):
        r = results[f"collect_{name}"]
        flag = "" if name == "auto" else f" --experts-per-load {PARTS}"
        rows.append(f"| routes collect --stream on --dtype bfloat16{flag} | {r['wall']:.0f} | "
                    f"{m['tokens'][name] / r['wall']:.1f} | {r['rss']:.2f} | {m['experts_per_load'][name]} | "
                    f"{note} |")
    sel, cut, again = results["select_reap"], results["prune_keep"], results["collect_pruned"]
    rows += [f"| select reap --top {KEEP} --groups {w['n_group']} | {sel['wall']:.1f} | | – | | reads the trace only |",
             f"| prune --keep to {KEEP} experts | {cut['wall']:.0f} | | {cut['rss']:.2f} | | "
             f"{m['bytes'] / 1e9:.1f} → {m['pruned_bytes'] / 1e9:.1f} GB, quant_method {m['pruned_quant_method']} |",
             f"| routes collect of the pruned checkpoint, as the first row | {again['wall']:.0f} | "
             f"{m['tokens']['pruned'] / again['wall']:.1f} | {again['rss']:.2f} | {m['experts_per_load']['pruned']} | "
             f"{m['pruned_experts']} experts |"]
    return "\n".join([
        mark[0], f"## A decoder layer bigger than memory: DeepSeek-V3's width {title} (bench/big_layer.py)", "",
        f"`.venv/bin/python bench/big_layer.py{' --format int4' if fmt == 'int4' else ''} --out {out} --write "
        f"BENCHMARKS.md` (the committed results: `--from {committed}`) — {m['date']}, {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']:.0f} GiB of memory. "
        "Random weights of "
        f"DeepSeek-V3's width (hidden {w['hidden_size']}, {w['n_routed_experts']} experts of "
        f"{w['moe_intermediate_size']} + 1 shared, top-8 of 8 groups, MLA, vocab {w['vocab_size']}), 2 decoder layers "
        f"(dense, then MoE) {layout}, "
        f"{m['bytes'] / 1e9:.1f} GB; {m['tokens']['auto']} tokens (3 languages × {VERSES} Bible verses). "
        "Each step is its own process; peak RSS is its VmHWM. Computed from the shapes, not measured: the whole "
        f"model takes {m['model_bf16_bytes'] / 2**30:.1f} GiB in bfloat16, so it does not load in memory; " + (
            "before `--experts-per-load`, the streamed capture held the whole MoE layer, and before that its model "
            "did not even build (its fused experts were allocated, 28 GiB in float32, and the allocation refused)."
            if fmt == "fp8" else "before moekit read pack-quantized checkpoints (2026-11-29), every step refused "
            "this one in one line."),
        "", *rows, mark[1]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=FORMATS, default="fp8", help="the checkpoint's layout (module docstring)")
    ap.add_argument("--out", type=Path, default=Path("runs/big_layer"))
    ap.add_argument("--write", type=Path, help="BENCHMARKS.md to update")
    ap.add_argument("--small", action="store_true", help="a tiny width and 2 verses per language (smoke test)")
    ap.add_argument("--from", dest="source", type=Path, help="write the section from this results.json (as committed "
                                                             "in FORMATS) without running anything")
    args = ap.parse_args()
    if args.small:
        global VERSES, PARTS, KEEP
        WIDTH.update(SMALL)
        VERSES, PARTS, KEEP = 2, 8, 16
    results = json.loads(args.source.read_text()) if args.source else run(args.out, args.format)
    text = section(results, args.out, args.format)
    print(text)
    if args.write:
        write_section(args.write, text, FORMATS[args.format][0])


if __name__ == "__main__":
    main()
