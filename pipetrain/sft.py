"""Supervised fine-tuning records: which tokens are trained.

Two record shapes besides plain text:
- {"prompt": ..., "completion": ...}: prompt tokens are context only; the completion and the EOS
  that ends it are trained.
- {"messages": [{"role": ..., "content": ...}, ...]}: rendered with the tokenizer's chat template;
  only the tokens each assistant turn adds are trained.
encode_record returns (token ids, mask) with mask[i] True when token i is a training target.

A chat template is a program (Jinja, in transformers' sandbox: no file, import or attribute escape, but its
loops run as long as they are written to), and a conversation renders once per turn: one conversation's
rendering is bounded in time (RENDER_SECONDS), so no template or record can hang a prepare.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from pipetrain.config import ConfigError

RENDER_SECONDS = 60.0  # one conversation, every prefix: real templates take milliseconds


class _Overtime(BaseException):
    """Raised into a render that ran past RENDER_SECONDS (a BaseException: the template's and transformers'
    own `except Exception` must not swallow it)."""


@contextmanager
def _time_limit(seconds: float):
    """Interrupt the block with _Overtime after seconds, in the main thread of a POSIX process (where prepare
    renders, datasets' worker processes included); elsewhere the block runs unbounded."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _Overtime

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:  # an assistant turn first: its prompt is the empty conversation, which transformers refuses
        return []      # to render; the turn is then trained whole, its opening marker too
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # the template's own raise_exception, or jinja's sandbox refusing what it asks for
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data: the tokenizer's chat template cannot render a conversation ({first}); fix the "
                          "record or use a tokenizer whose template renders it") from None
    return _ids(tokenizer, text)


def encode_chat(messages: list[dict], tokenizer) -> tuple[list[int], list[bool]]:
    """Render a conversation and mark the tokens of assistant turns (rendering prefixes to find them), within
    RENDER_SECONDS."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data: records have 'messages' but the tokenizer has no chat_template; "
                          "use a tokenizer with one or prompt/completion records")
    try:
        with _time_limit(RENDER_SECONDS):
            return _encode_chat(messages, tokenizer)
    except _Overtime:
        raise ConfigError(f"data: the tokenizer's chat template took more than {RENDER_SECONDS:g} s to render one "
                          f"conversation of {len(messages)} messages (a template that loops without end, or a "
                          "conversation too long to render turn by turn); fix the template or split the "
                          "conversation") from None


def _encode_chat(messages: list[dict], tokenizer) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(f"data: message {i} must be an object with 'role' and 'content', got {message!r}")
        assistant = message["role"] == "assistant"
        if assistant:  # the prompt that opens an assistant turn is context, not a target
            prefix = _chat_ids(tokenizer, messages[:i], generation_prompt=True)
            if prefix[:len(ids)] != ids:
                raise ConfigError("data: the tokenizer's chat template does not render the generation prompt "
                                  "incrementally, so assistant tokens cannot be located; use prompt/completion")
            mask += [False] * (len(prefix) - len(ids))
            ids = prefix
        full = _chat_ids(tokenizer, messages[:i + 1], generation_prompt=False)
        if full[:len(ids)] != ids:
            raise ConfigError("data: the tokenizer's chat template does not render conversations "
                              "incrementally, so assistant tokens cannot be located; use prompt/completion")
        mask += [assistant] * (len(full) - len(ids))
        ids = full
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
        mask.append(bool(messages) and messages[-1].get("role") == "assistant")
    return ids, mask


def encode_record(record: dict, tokenizer) -> tuple[list[int], list[bool]]:
    """(ids, mask) for one prompt/completion or messages record; EOS closes each record."""
    if "messages" in record and record["messages"] is not None:
        return encode_chat(record["messages"], tokenizer)
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ConfigError(f"data: a prompt/completion record needs two strings, got {record!r:.120}")
    p, c = _ids(tokenizer, prompt), _ids(tokenizer, completion)
    return p + c + [tokenizer.eos_token_id], [False] * len(p) + [True] * (len(c) + 1)
