"""Chat with a model: its chat template, text streamed as tokens come, and a conversation in a terminal.

    messages = [{"role": "user", "content": "Hi"}]
    ids = chat_ids(tokenizer, messages)                       # [1, P]: the template, the assistant's turn opened
    stream = TextStream(tokenizer, write)
    generate(steps, cache, ids, sample, stop_ids(tokenizer, generation_config), stream.add); stream.end()

An -Instruct model answers well only inside the template it was tuned on, and ends its turn with a
token of its own (``<|im_end|>`` for SmolLM2): the tokenizer's eos or one of its generation config's
eos ids, where generation stops. ``converse`` is ``gmc generate -i``: it reads a line after the marker,
streams the reply and keeps the conversation; each turn prefills the whole conversation again from
position 0 of the one cache (simplest correct: no cache bookkeeping across turns, and a prefill of a
few hundred tokens costs about what a handful of decode steps do), dropping the oldest exchanges when
the conversation and the reply's tokens outgrow the cache.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from transformers import TextStreamer

from gmc.errors import GmcError

MARKER = ">>> "  # what -i prints before reading a message
CHAT_MAX_LEN = 2048  # -i's cache positions unless --max-len or the model's own limit says otherwise

Reply = Callable[[torch.Tensor, Callable[[int], None]], object]  # (ids [1, P], on_token) -> Generation


class TextStream(TextStreamer):
    """Writes the text of tokens as they come, decoded by transformers' ``TextStreamer`` rule: the
    tokens since the last newline are decoded together and only text not written yet goes out. A
    token may complete a multi-byte character (decoded as ``\\ufffd`` until then) or change how a word
    decodes, so text that may still change waits for the next space, unless it is letters, digits or
    a CJK character. Special tokens (the end of a turn) are not written. ``prompt [P]``: ids whose
    text goes out with the first token, decoded with what follows."""

    def __init__(self, tokenizer, write: Callable[[str], None], prompt: Optional[torch.Tensor] = None):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.write, self.prompt = write, prompt

    def add(self, token: int) -> None:
        """The callback ``generate`` calls with each new token."""
        if self.prompt is not None:
            self.token_cache.extend(self.prompt.tolist())
            self.prompt = None
        self.put(torch.tensor([token]))

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        text = text + "\n" if stream_end else text
        if text:
            self.write(text)


def write_stdout(text: str) -> None:
    """Write and flush, so a terminal shows each piece as it is made."""
    sys.stdout.write(text)
    sys.stdout.flush()


def write_stderr(text: str) -> None:
    sys.stdout.flush()  # what was streamed comes before the note
    sys.stderr.write(text)
    sys.stderr.flush()


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def stop_ids(tokenizer, generation_config=None) -> set[int]:
    """The ids that end a generation: the tokenizer's eos and every eos id of the model's generation
    config (an end-of-turn token that is not the tokenizer's eos is listed there)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        ids |= {source} if isinstance(source, int) else set(source or ())
    return ids


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """``[1, P]`` ids of ``messages`` (``{"role", "content"}`` dicts) under the tokenizer's chat
    template, ending with the opened assistant turn (``add_generation_prompt``)."""
    from jinja2 import TemplateError

    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
    except TemplateError as error:  # a template may refuse a conversation (roles out of order)
        raise GmcError(f"the tokenizer's chat template refused the conversation: {error}") from error
    return torch.tensor([list(encoded["input_ids"])], dtype=torch.long)


def fit_conversation(tokenizer, messages: list[dict], max_len: int,
                     max_new_tokens: int) -> tuple[torch.Tensor, list[dict]]:
    """``(ids [1, P], kept)``: the conversation without its oldest messages (user and assistant in
    pairs; a leading system message stays) and its ids, so that ``P + max_new_tokens`` fits a cache of
    ``max_len`` positions. A last message too long on its own is a ``GmcError``."""
    room = max_len - max_new_tokens
    kept = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while True:
        shorter = messages[:kept] + messages[kept + dropped:]
        ids = chat_ids(tokenizer, shorter)
        if ids.shape[1] <= room:
            return ids, shorter
        if kept + dropped + 1 >= len(messages):
            raise GmcError(f"the message takes {ids.shape[1]} tokens with the chat template, more than the {room} "
                           f"a cache of {max_len} positions leaves beside --max-new-tokens {max_new_tokens}: "
                           f"shorten it or raise --max-len")
        dropped += 2


def converse(reply: Reply, tokenizer, max_len: int, max_new_tokens: int,
             read: Callable[[str], str] = input, write: Callable[[str], None] = write_stdout,
             note: Callable[[str], None] = write_stderr, first: Optional[str] = None) -> list[dict]:
    """A conversation: read a message after ``MARKER`` (``first`` is the first one when given), stream
    the reply of ``reply(ids, on_token)`` through ``write``, repeat; return the messages. End of input
    (Ctrl-D) or Ctrl-C at the marker ends it; Ctrl-C during a reply stops that reply, which stays in
    the conversation as far as it was generated. ``note`` gets each turn's speed line and what was
    dropped or refused, so a too-long message is refused without ending the conversation."""
    if read is input and sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    messages: list[dict] = []
    pending = first
    while True:
        if pending is None:
            try:
                pending = read(MARKER)
            except (EOFError, KeyboardInterrupt):
                write("\n")
                return messages
        text, pending = pending, None
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids, kept = fit_conversation(tokenizer, messages, max_len, max_new_tokens)
        except GmcError as error:
            messages.pop()
            note(f"gmc: error: {error}\n")
            continue
        dropped = len(messages) - len(kept)
        if dropped:
            messages[:] = kept
            note(f"gmc: the conversation outgrew the cache of {max_len} positions: dropped its {dropped} "
                 f"oldest messages\n")
        _answer(reply, tokenizer, ids, messages, write, note)


def _answer(reply: Reply, tokenizer, ids: torch.Tensor, messages: list[dict], write, note) -> None:
    """Stream one reply to the last message and append it to ``messages``."""
    stream, tokens = TextStream(tokenizer, write), []

    def on_token(token: int) -> None:
        tokens.append(token)
        stream.add(token)

    try:
        generation = reply(ids, on_token)
    except KeyboardInterrupt:
        generation = None
    stream.end()
    if tokens:
        messages.append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})
    else:
        messages.pop()  # stopped before a token: the message goes unanswered and unrecorded
    note(generation.summary() + "\n" if generation is not None else "gmc: reply stopped\n")
