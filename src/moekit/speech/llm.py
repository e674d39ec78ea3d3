"""Speech-LLMs (audio encoder -> adapter -> decoder-only LM) as speech-LLM recipes use them: the model's own
processor (feature extractor, tokenizer, chat template) builds every input, a family says only what goes into the
conversation and which modules are the audio encoder and adapter.

Training sequence: the chat-template prompt for the example (audio placeholder expanded by the processor to the
clip's audio tokens) + the target text + the tokenizer's eos (the turn end); labels are the target and eos, every
prompt and padding position -100. Generation: the same prompt, left-padded, greedy.

Families (SPEECH_LLMS, by config model_type):
  qwen3_asr    Qwen3-ASR (SPRI §3.2): the processor's own transcription request (`apply_transcription_request`):
               user turn = the audio, assistant turn prefilled with `language <NAME><asr_text>`, which fixes the
               output language; for translation NAME is the target language, for transcription English.
               Qwen3-ASR's processor knows 30 language names; the other CoVoST 2 targets (Catalan, Welsh, Estonian,
               Mongolian, Latvian, Slovenian, Tamil) take their English names in the same place. An `instruction`
               goes where the processor puts its `prompt` (the system turn).
  qwen2_audio  Qwen2-Audio: user turn = the audio, then the instruction (Qwen2-Audio has no task-forcing prompt of
               its own; the default instruction is moekit's wording, e.g. "Translate the English speech into German.").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import ConfigError
from moekit.speech.s2tt import NAMES, Example

DEFAULT_INSTRUCTION = {"translate": "Translate the {src_name} speech into {tgt_name}.",
                       "transcribe": "Transcribe the {src_name} speech."}


@dataclass(frozen=True)
class Family:
    model_type: str
    audio_modules: tuple[str, ...]  # attribute names of the audio encoder and the adapter (under the model's `model`)

    def conversation(self, e: Example, instruction: str | None, names: dict[str, str]) -> tuple[list[dict], bool]:
        """(chat messages, whether the last one is an assistant prefill the model continues)."""
        raise NotImplementedError


class Qwen3ASR(Family):
    def conversation(self, e, instruction, names):
        messages = [] if instruction is None else [{"role": "system", "content": [{"type": "text", "text": _fill(
            instruction, e)}]}]
        prefill = f"language {names.get(e.tgt, NAMES[e.tgt])}<asr_text>"
        return messages + [{"role": "user", "content": [{"type": "audio"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": prefill}]}], True


class Qwen2Audio(Family):
    def conversation(self, e, instruction, names):
        text = _fill(instruction or DEFAULT_INSTRUCTION["transcribe" if e.tgt == e.src else "translate"], e)
        return [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": text}]}], False


def _fill(template: str, e: Example) -> str:
    return template.format(src_name=NAMES[e.src], tgt_name=NAMES[e.tgt])


SPEECH_LLMS = {f.model_type: f for f in (Qwen3ASR("qwen3_asr", ("audio_tower", "multi_modal_projector")),
                                         Qwen2Audio("qwen2_audio", ("audio_tower", "multi_modal_projector")))}


def family_of(config, where: str) -> Family:
    """The speech-LLM family of a model config; ConfigError for a model without an audio encoder."""
    kind = getattr(config, "model_type", None)
    if kind not in SPEECH_LLMS:
        raise ConfigError(f"{where} is a {kind} model, not a speech-LLM: task speech_llm trains "
                          f"{', '.join(SPEECH_LLMS)} models (audio encoder + adapter + language model)")
    return SPEECH_LLMS[kind]


def audio_paths(model, family: Family) -> list[str]:
    """Module paths of the audio encoder and the adapter in `model` (e.g. model.audio_tower)."""
    wanted = set(family.audio_modules)
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in wanted]


class SpeechLLMInputs:
    """Model inputs for a speech-LLM from Examples, through its processor."""

    def __init__(self, processor, family: Family, instruction: str | None = None):
        from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

        self.processor, self.family, self.instruction = processor, family, instruction
        self.tok = processor.tokenizer
        self.names = LANGUAGE_CODE_TO_NAME if family.model_type == "qwen3_asr" else {}
        if self.tok.eos_token_id is None:
            raise ConfigError("the speech-LLM's tokenizer has no eos token (targets end with it)")
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

    def prompt(self, e: Example) -> str:
        """The chat-template prompt as text, the audio as the template's one placeholder."""
        messages, prefill = self.family.conversation(e, self.instruction, self.names)
        return self.processor.apply_chat_template([messages], tokenize=False, add_generation_prompt=not prefill,
                                                  continue_final_message=prefill)[0]

    def target_ids(self, e: Example) -> list[int]:
        return self.tok(e.target, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def prompt_tokens(self, e: Example) -> int:
        """Prompt (audio placeholder unexpanded) + target tokens: what data.max_prompt_tokens bounds (SPRI A.2)."""
        return len(self.tok(self.prompt(e), add_special_tokens=False)["input_ids"]) + len(self.target_ids(e))

    def audio_tokens(self, seconds: float) -> int:
        """The audio tokens the processor expands a clip of `seconds` into (the decoder positions it takes)."""
        import numpy as np

        audio = self.processor.audio_token
        enc = self.processor(text=[audio], audio=[np.zeros(round(seconds * 16000), "float32")], sampling_rate=16000,
                             return_tensors="pt")
        return int((enc["input_ids"] == self.tok.convert_tokens_to_ids(audio)).sum())

    def prompts(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        """The processor's inputs for the prompts of `batch`, left-padded: input_ids, attention_mask, audio
        features."""
        self.tok.padding_side = "left"
        return dict(self.processor(text=[self.prompt(e) for e in batch], audio=[e.samples() for e in batch],
                                   sampling_rate=16000, padding=True, return_tensors="pt"))

    def __call__(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        """Training batch: prompt + target + eos, right-padded; labels on the target and eos only."""
        enc = self.prompts(batch)
        ids, mask = enc.pop("input_ids"), enc.pop("attention_mask")
        rows = [(ids[i][mask[i].bool()].tolist(), self.target_ids(e)) for i, e in enumerate(batch)]
        n = max(len(p) + len(t) for p, t in rows)
        out = {"input_ids": torch.full((len(rows), n), self.pad), "attention_mask": torch.zeros(len(rows), n, dtype=torch.long),
               "labels": torch.full((len(rows), n), -100)}
        for i, (p, t) in enumerate(rows):
            out["input_ids"][i, :len(p) + len(t)] = torch.tensor(p + t)
            out["attention_mask"][i, :len(p) + len(t)] = 1
            out["labels"][i, len(p):len(p) + len(t)] = torch.tensor(t)
        return {**out, **enc}

    def generate(self, model, batch: list[Example], max_new_tokens: int) -> list[str]:
        """Greedy outputs for `batch`, decoded as Qwen2-Audio's evaluation decodes them (skip_special_tokens,
        clean_up_tokenization_spaces=False), stripped."""
        enc = {k: v.to(model.device) for k, v in self.prompts(batch).items()}
        gen = model.generate(**enc, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=1,
                             eos_token_id=self.tok.eos_token_id, pad_token_id=self.pad)
        new = gen[:, enc["input_ids"].shape[1]:]
        return [t.strip() for t in self.tok.batch_decode(new, skip_special_tokens=True,
                                                         clean_up_tokenization_spaces=False)]


def load_processor(path, trust_remote_code: bool = False):
    """The model directory's processor (feature extractor + tokenizer + chat template)."""
    from transformers import AutoProcessor

    from moekit.checkpoint.dense import check_remote_code

    check_remote_code(path, trust_remote_code)
    try:
        proc = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} has no usable processor: {' '.join(str(e).split())[:300]}") from None
    if not getattr(proc, "chat_template", None) or not hasattr(proc, "feature_extractor"):
        raise ConfigError(f"{path}: its processor lacks a chat template or a feature extractor (a speech-LLM's "
                          "processor has both)")
    return proc
