"""mergekit-moe 0.1.5's command-line flags as `moekit upcycle` takes them (docs/guides/mergekit.md):
the table below says, for every flag of mergekit-moe (scripts/moe.py and MergeOptions), what moekit does with it.
Read without importing torch, so that `--help` stays fast."""
from __future__ import annotations

from moekit.errors import ConfigError

# mergekit-moe 0.1.5's command line (scripts/moe.py, options.py MergeOptions) and what `moekit upcycle` does with
# each flag: (kind, takes a value, what it does). kind "same": moekit does what mergekit does; "no-op": accepted,
# nothing to do, with the reason; "refused": moekit has no equivalent (one line naming what to do instead).
MERGEKIT_FLAGS: dict[str, tuple[str, bool, str]] = {
    "--out-shard-size": ("same", True, "largest output shard in parameters, mergekit's unit (5B = 5e9; K, M, B "
                                       "suffixes): --max-shard-size of that many parameters in the output dtype"),
    "--copy-tokenizer": ("no-op", False, "moekit always copies the base model's tokenizer files"),
    "--lazy-unpickle": ("no-op", False, "moekit always streams, one tensor at a time (pickles need --allow-pickle)"),
    "--low-cpu-memory": ("no-op", False, "moekit always streams: memory is about one FFN, whatever the device"),
    "--cuda": ("same", False, "--device cuda: the init math and prompt hidden states run on the GPU"),
    "--gpu-rich": ("same", False, "--device cuda (mergekit's alias for --cuda --low-cpu-memory --read-to-gpu "
                                  "--multi-gpu; moekit uses one GPU)"),
    "--read-to-gpu": ("no-op", False, "with --device cuda each tensor moves to the GPU as it is read"),
    "--device": ("same", True, "where the init math runs: auto, cpu, cuda or cuda:N"),
    "--trust-remote-code": ("same", False, "allow models whose directory ships its own Python code"),
    "--random-seed": ("same", True, "--seed: the random gates (gate_mode random) and noise"),
    "--i-understand-this-is-not-useful-without-training": ("same", False, "build experts that all come from one "
                                                                          "model (--allow-same-experts)"),
    "--allow-crimes": ("same", False, "allow source models of different architectures (model_type), which are "
                                      "refused otherwise, as mergekit-moe refuses them"),
    "--transformers-cache": ("same", True, "the Hugging Face cache that Hub ids resolve in (HF_HUB_CACHE)"),
    "--num-threads": ("same", True, "CPU threads of the init math (torch.set_num_threads)"),
    "--quiet": ("same", False, "no progress lines on stderr"),
    "--verbose": ("no-op", False, "progress is always reported per MoE layer"),
    "--clone-tensors": ("no-op", False, "every tensor is written on its own"),
    "--write-model-card": ("no-op", False, "moekit always writes a model card (README.md) and the config"),
    "--safe-serialization": ("no-op", False, "moekit writes safetensors only"),
    "--async-write": ("no-op", False, "shards are written as they are computed"),
    "--write-threads": ("no-op", True, "shards are written by the one streaming writer"),
    "--multi-gpu": ("refused", False, "moekit's init math runs on one device: use --device cuda:N"),
    "--load-in-4bit": ("refused", False, "the hidden states of gate_mode hidden are computed in float32 from one "
                                         "decoder layer at a time, which needs no quantization: leave the flag out"),
    "--load-in-8bit": ("refused", False, "the hidden states of gate_mode hidden are computed in float32 from one "
                                         "decoder layer at a time, which needs no quantization: leave the flag out"),
    "--lora-merge-cache": ("refused", True, "LoRA references (model+lora) are not supported: merge the LoRA into "
                                            "the model first"),
    "--lora-merge-dtype": ("refused", True, "LoRA references (model+lora) are not supported: merge the LoRA into "
                                            "the model first"),
    "--unsafe-truncate-embeddings": ("refused", False, "every source must have the base model's vocabulary"),
}
# mergekit's boolean flags with a --no- form: for each, the --no- form that moekit refuses (it cannot do without)
MERGEKIT_REFUSED_NEGATIONS = {
    "--no-copy-tokenizer": "moekit always copies the base model's tokenizer: delete its files from the output",
    "--no-write-model-card": "moekit always writes a model card: delete README.md from the output",
    "--no-safe-serialization": "moekit writes safetensors only, never pickles",
}


def parse_kmb(text: str) -> int:
    """mergekit's count syntax: 1000, 10K, 500M, 5B (thousands, millions, billions)."""
    value = str(text).strip()
    scale = {"k": 10**3, "m": 10**6, "b": 10**9}.get(value[-1:].lower(), 1)
    digits = value[:-1] if scale > 1 else value
    if not digits.isdigit() or int(digits) < 1:
        raise ConfigError(f"{text!r} is not a count such as 1000, 500M or 5B")
    return int(digits) * scale
