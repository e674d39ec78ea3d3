"""Chat records ({messages: [{role, content}, ...]}, or ShareGPT's {conversations: [{from, value}, ...], system?}
as LLaMA-Factory writes them) encoded with the tokenizer's chat template, loss on the assistant turns only.

Assistant turns are located by rendering prefixes of the conversation: turn i spans from the end of
`render(messages[:i], add_generation_prompt=True)` to the end of `render(messages[:i + 1])`, so it holds the
turn's content and the template's end-of-turn text (what the model must learn to emit), not the role header
that the generation prompt supplies at inference. Templates that do not render conversations incrementally
(each prefix's rendering a prefix of the next) are refused rather than guessed at. Each span is tokenized
on its own, so no token straddles a prompt/answer boundary; the prompt side of every assistant turn is
exactly what `apply_chat_template(..., add_generation_prompt=True)` gives at inference.

The template comes with the model and is untrusted: transformers renders it in Jinja's sandbox (which stops a
template that reaches for Python internals), and each rendering here gets RENDER_SECONDS (a template can loop for
ever: nested `range` loops); either is one ConfigError naming the record.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time

from moekit.errors import ConfigError

Span = tuple[int, int, bool]  # (start, end, scored) in characters of the rendered conversation


def check_messages(messages, where: str) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ConfigError(f"{where}: expected a column 'messages' holding a non-empty list of {{role, content}} "
                          "strings")
    if messages[0]["role"] == "assistant":
        raise ConfigError(f"{where}: the conversation starts with an assistant turn (nothing to answer)")
    return messages


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def messages_of(record: dict, where: str) -> list[dict]:
    """The record's conversation as {role, content} messages: its `messages`, or ShareGPT's `conversations` of
    {from, value} (human -> user, gpt -> assistant, system) after its optional `system` prompt."""
    if "messages" in record or "conversations" not in record:
        return check_messages(record.get("messages"), where)
    turns, system = record["conversations"], record.get("system")
    ok = isinstance(turns, list) and turns and all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                                   and isinstance(t.get("from"), str) for t in turns)
    if not ok:
        raise ConfigError(f"{where}: expected a column 'conversations' holding a non-empty list of {{from, value}} "
                          "strings (ShareGPT)")
    other = sorted({t["from"] for t in turns} - SHAREGPT_ROLES.keys())
    if other:
        raise ConfigError(f"{where}: ShareGPT turns from {', '.join(map(repr, other))} (tool calls and their "
                          f"results) are not supported; the roles read are {', '.join(SHAREGPT_ROLES)}")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{where}: column 'system' must hold text")
    prompt = [{"role": "system", "content": system}] if system else []
    return check_messages(prompt + [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns], where)


RENDER_SECONDS = 10  # one rendering of a conversation takes milliseconds


@contextlib.contextmanager
def time_limit(seconds: float):
    """TimeoutError inside the block once `seconds` have passed (SIGALRM, so in the main thread only; elsewhere
    no limit). A timer set before (e.g. a caller's alarm) still fires when it was due, or is re-armed after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    start, previous = time.monotonic(), signal.getsignal(signal.SIGALRM)
    due, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    outer = {"first": 0 < due < seconds, "fired": False}

    def expire(signum, frame):
        if outer["first"] and not outer["fired"]:  # the caller's timer: its handler runs, ours goes on
            outer["fired"] = True
            signal.setitimer(signal.ITIMER_REAL, max(seconds - (time.monotonic() - start), 1e-3))
            if callable(previous):
                previous(signum, frame)
            return
        raise TimeoutError

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, due if outer["first"] else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if due and not outer["fired"]:
            signal.setitimer(signal.ITIMER_REAL, max(due - (time.monotonic() - start), 1e-3), interval)


def render(tok, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
    """The chat template's text of `messages`, within RENDER_SECONDS; a template that fails, takes too long or
    tries to leave Jinja's sandbox is one ConfigError."""
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    what = f"{where}: the tokenizer's chat template"
    try:
        with time_limit(RENDER_SECONDS):
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TimeoutError:
        raise ConfigError(f"{what} did not finish rendering within {RENDER_SECONDS} s (a loop without end?); use "
                          "another template") from None
    except SecurityError as e:
        raise ConfigError(f"{what} tried to leave the Jinja sandbox ({str(e).rstrip('.')}); the sandbox held and "
                          "stopped it; use another template") from None
    except (TemplateError, RecursionError) as e:
        raise ConfigError(f"{what} fails on this conversation: {' '.join(str(e).split())}") from None


def assistant_spans(tok, messages: list[dict], where: str) -> tuple[str, list[Span]]:
    """(the rendered conversation, its spans in order, covering it, assistant turns scored)."""
    full = render(tok, messages, where)
    spans, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(tok, messages[:i], where, True), render(tok, messages[:i + 1], where)
        if not (full.startswith(end) and end.startswith(start) and len(start) >= pos):
            raise ConfigError(f"{where}: the tokenizer's chat template does not render this conversation "
                              "incrementally (a prefix renders differently inside the whole), so its assistant "
                              "turns cannot be located; use data.format=alpaca or another template")
        spans += [(pos, len(start), False), (len(start), len(end), True)]
        pos = len(end)
    return full, [*spans, (pos, len(full), False)]


def encode_chat(record: dict, tok, cfg, where: str) -> dict[str, list[int]]:
    """input_ids of the rendered conversation, labels = input_ids on assistant turns, -100 elsewhere."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError("data.format=chat needs a tokenizer with a chat template (tokenizer_config.json "
                          "'chat_template' or chat_template.jinja); this one has none: use data.format=alpaca")
    text, spans = assistant_spans(tok, messages_of(record, where), where)
    ids, labels = [], []
    for start, end, scored in spans:
        if start < end:
            piece = tok(text[start:end], add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if scored else [-100] * len(piece)
    return {"input_ids": ids[:cfg.max_length], "labels": labels[:cfg.max_length]}
