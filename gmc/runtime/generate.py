"""gmc's generation loop over prefill/decode steps (``gmc.graph.decode``): eager, exported, compiled or graphed.

    cache = KVCache.empty(config, max_len)
    logits = prefill(prompt [1, P], 0, cache)            # P == 1: the decode step
    for i in range(max_new_tokens):
        token = greedy or sampled(logits)                # repetition penalty; temperature, top-k, top-p, seeded
        on_token(token); stop at an eos id; logits = decode(token [1, 1], P + i, cache)

A step is any callable with the ``CachedLM`` signature: a ``CachedLM`` itself (the eager model,
dense or lowered), an exported program's ``.module()``, an AOTInductor runner
(``gmc.formats.compiled``), or a recorded CUDA graph (``gmc.runtime.cuda_graph``: what ``--compile``
runs on CUDA, its decode step one graph replay). The same loop drives all of them, so their tokens
and speeds compare like with like. Timings are wall clock around each step call; ``Generation.summary`` is the one line
``gmc generate`` prints. ``run_generate`` is ``gmc generate``: the prompt as text to continue or, with a
tokenizer's chat template, as a user's message (``gmc.runtime.chat``, where ``-i`` lives too), its text
streamed through ``on_token`` as it is made.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Union

import torch

from gmc.config import (
    base_model_option,
    check_at_least,
    device_option,
    dtype_option,
    option,
    trust_remote_code_option,
)
from gmc.errors import GmcError
from gmc.graph.decode import KVCache
from gmc.runtime.chat import (
    CHAT_MAX_LEN,
    MARKER,
    TextStream,
    chat_ids,
    converse,
    has_chat_template,
    stop_ids,
    write_stderr,
    write_stdout,
)

Step = Callable[..., torch.Tensor]  # (input_ids [1, T], position [], keys, values) -> logits [1, V]


@dataclass
class SampleConfig:
    """How tokens are chosen: greedy (``temperature == 0``) or sampled with an optional top-k and top-p,
    either after an optional repetition penalty (the order of HF's logits processors)."""

    max_new_tokens: int = option(64, "Tokens to generate at most.")
    temperature: float = option(0.0, "0: greedy; > 0: sample from softmax(logits / temperature).")
    top_k: Optional[int] = option(None, "Sample only among the k likeliest tokens.")
    top_p: float = option(1.0, "Sample only among the likeliest tokens whose probabilities sum to p (nucleus).")
    repetition_penalty: float = option(1.0, "Divide positive logits (multiply negative ones) of the tokens already "
                                            "in the sequence by this (> 1 discourages repeats; 1: off).")
    seed: int = option(0, "Seed of the sampling.")

    def __post_init__(self):
        check_at_least("--max-new-tokens", self.max_new_tokens, 1)
        if not self.temperature >= 0.0:
            raise GmcError(f"bad --temperature {self.temperature}: expected >= 0 (0 is greedy)")
        if self.top_k is not None:
            check_at_least("--top-k", self.top_k, 1)
        if not 0.0 < self.top_p <= 1.0:
            raise GmcError(f"bad --top-p {self.top_p}: expected 0 < p <= 1 (1 keeps every token)")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise GmcError(f"bad --repetition-penalty {self.repetition_penalty}: expected a finite number > 0 "
                           f"(1: off)")


@dataclass
class Generation:
    """Generated token ids and how long each step took."""

    prompt_tokens: int
    tokens: list = field(default_factory=list)  # new token ids
    prefill_s: float = 0.0
    decode_s: list = field(default_factory=list)  # seconds per decode step

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.decode_s) / sum(self.decode_s) if self.decode_s else float("nan")

    def summary(self) -> str:
        """``prefill 32 tokens in 120.0 ms (266.7 tok/s); decode 63 tokens at 31.2 ms/token (32.1 tok/s)``."""
        line = (f"prefill {self.prompt_tokens} tokens in {self.prefill_s * 1e3:.1f} ms "
                f"({self.prompt_tokens / self.prefill_s:.1f} tok/s)")
        if self.decode_s:
            median = sorted(self.decode_s)[len(self.decode_s) // 2]
            line += (f"; decode {len(self.decode_s)} tokens at {median * 1e3:.1f} ms/token median "
                     f"({self.decode_tokens_per_s:.1f} tok/s overall)")
        return line


def choose(logits: torch.Tensor, config: SampleConfig, generator: torch.Generator,
           seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Next token ``[1, 1]`` from last-token ``logits [1, V]``; ``seen [1, S]``: the ids of the sequence
    so far, which the repetition penalty reads (greedy included, as in HF)."""
    if config.repetition_penalty != 1.0 and seen is not None:
        logits = penalize_repeats(logits, seen, config.repetition_penalty)
    if config.temperature == 0.0:
        return logits.argmax(-1, keepdim=True)
    scores = logits.float() / config.temperature
    if config.top_k is not None and config.top_k < scores.shape[-1]:
        kth = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        scores = nucleus(scores, config.top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The CTRL rule (Keskar et al. 2019; HF's ``RepetitionPenaltyLogitsProcessor``): each token of
    ``seen [1, S]`` gets its logit divided by ``penalty`` if positive, multiplied if negative, so a
    penalty > 1 always makes it less likely, however often it occurs. logits ``[1, V]``."""
    picked = logits.gather(-1, seen.to(logits.device))  # [1, S]
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(-1, seen.to(logits.device), picked)


def nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores [1, V]`` with -inf outside the nucleus: the likeliest tokens whose probabilities first
    reach ``top_p`` (a token stays when the tokens likelier than it hold less than ``top_p``, so the
    likeliest always stays; HF's ``TopPLogitsWarper`` rule)."""
    ordered, order = scores.sort(dim=-1, descending=True)  # [1, V]
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # [1, V]: mass of the strictly likelier tokens
    outside = before >= top_p  # [1, V], in likelihood order
    return scores.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))


@torch.no_grad()
def generate(steps: Mapping[str, Step], cache: KVCache, prompt_ids: torch.Tensor, config: SampleConfig,
             eos_token_id: Union[int, Iterable[int], None] = None,
             on_token: Optional[Callable[[int], None]] = None) -> Generation:
    """Run ``steps["prefill"]`` on ``prompt_ids [1, P]`` then ``steps["decode"]`` token by token, stopping
    after any of the ids ``eos_token_id``. ``on_token(id)`` sees each new token as soon as it is chosen,
    before the next step runs (what streams the text), outside the timed steps."""
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
        raise GmcError(f"prompt ids must be [1, P] with P >= 1, got {list(prompt_ids.shape)}")
    prompt = prompt_ids.shape[1]
    if prompt + config.max_new_tokens > cache.max_len:
        raise GmcError(f"prompt of {prompt} tokens + max_new_tokens {config.max_new_tokens} exceeds the cache "
                       f"of {cache.max_len} positions: lower max_new_tokens or make a longer cache")
    device = cache.keys[0].device
    generator = torch.Generator().manual_seed(config.seed)
    result = Generation(prompt_tokens=prompt)
    step = steps["prefill"] if prompt > 1 else steps["decode"]
    start = time.perf_counter()
    logits = step(prompt_ids.to(device), torch.tensor(0, device=device), cache.keys, cache.values)
    _finish(logits)
    result.prefill_s = time.perf_counter() - start
    seen = prompt_ids.to(device) if config.repetition_penalty != 1.0 else None  # [1, P + i]
    for i in range(config.max_new_tokens):
        token = choose(logits, config, generator, seen)
        result.tokens.append(int(token))
        if on_token is not None:
            on_token(int(token))
        if i + 1 == config.max_new_tokens or int(token) in stops:
            break
        if seen is not None:
            seen = torch.cat([seen, token], dim=-1)
        start = time.perf_counter()
        logits = steps["decode"](token, torch.tensor(prompt + i, device=device), cache.keys, cache.values)
        _finish(logits)
        result.decode_s.append(time.perf_counter() - start)
    return result


def _finish(logits: torch.Tensor) -> None:
    """Wait for a step's device work (CUDA runs it after the call returns): a step's time is its work."""
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)


DEFAULT_PROMPT = "The hacker"


@dataclass
class GenerateConfig:
    """What ``gmc generate`` runs: a model ref, masks artifact or lowered directory, and a prompt (or a
    conversation, ``interactive``)."""

    ref: str
    prompt: Optional[str] = option(None, f"Text to continue; with a chat template, the user's message; - reads "
                                         f"stdin [default: {DEFAULT_PROMPT!r}; none with -i].")
    prompt_file: Optional[str] = option(None, "Read the prompt from FILE (-: stdin); its last line end is dropped.",
                                        metavar="FILE")
    chat: Optional[bool] = option(None, "Put the prompt in the tokenizer's chat template and stop at its end of "
                                        "turn [default: when the tokenizer has a chat template].", optional=True)
    interactive: bool = option(False, f"Chat turn by turn: type a message after {MARKER.strip()!r}, its reply "
                                      f"streams; Ctrl-D or Ctrl-C there ends, Ctrl-C during a reply stops it.",
                               short="-i")
    max_len: Optional[int] = option(None, f"KV cache positions, which bound a conversation [default: the prompt + "
                                          f"--max-new-tokens; with -i {CHAT_MAX_LEN}, or the model's maximum if "
                                          f"fewer].")
    sample: SampleConfig = field(default_factory=SampleConfig)
    compile: bool = option(False, "CPU: export prefill/decode programs and compile them with AOTInductor first (a "
                                  "lowered directory made with `gmc lower --compile` runs its own compiled programs "
                                  "without this flag). CUDA: record the decode step as one CUDA graph and replay it "
                                  "per token.")
    dtype: str = dtype_option()
    device: str = device_option()
    model: Optional[str] = base_model_option()
    trust_remote_code: bool = trust_remote_code_option()
    threads: Optional[int] = option(None, "CPU threads [default: torch's].")

    def __post_init__(self):
        from gmc.inputs.model import device_and_dtype

        if self.prompt is not None and self.prompt_file is not None:
            raise GmcError("give --prompt or --prompt-file, not both")
        if self.prompt == "":
            raise GmcError("empty --prompt: give some text to continue")
        if self.interactive and self.chat is False:
            raise GmcError("-i chats in the tokenizer's chat template: leave out --no-chat")
        if self.interactive and "-" in (self.prompt, self.prompt_file):
            raise GmcError("-i reads the conversation from stdin: give a first message as --prompt TEXT or "
                           "--prompt-file FILE, not -")
        if self.prompt is None and self.prompt_file is None and not self.interactive:
            self.prompt = DEFAULT_PROMPT
        if self.max_len is not None:
            check_at_least("--max-len", self.max_len, 2)
        self.device, self.dtype = device_and_dtype(self.device, self.dtype)
        if self.threads is not None:
            check_at_least("--threads", self.threads, 1)


@dataclass
class Generated:
    text: str  # prompt + completion; a chat: the reply
    generation: Generation
    how: str  # "compiled lowered (AOTInductor, cpu)", "eager dense", ...
    chat: bool = False

    def record(self) -> dict:
        """What ``gmc generate --json`` prints (rates are None where nothing was timed)."""
        done = self.generation
        median = sorted(done.decode_s)[len(done.decode_s) // 2] if done.decode_s else None
        return {"text": self.text, "tokens": done.tokens, "prompt_tokens": done.prompt_tokens,
                "new_tokens": len(done.tokens), "prefill_s": done.prefill_s,
                "prefill_tokens_per_s": done.prompt_tokens / done.prefill_s if done.prefill_s else None,
                "decode_tokens_per_s": done.decode_tokens_per_s if done.decode_s else None,
                "decode_ms_per_token_median": median * 1e3 if median is not None else None,
                "how": self.how, "chat": self.chat, "threads": torch.get_num_threads()}


def run_generate(config: GenerateConfig, write: Optional[Callable[[str], None]] = None) -> Generated:
    """Load ``config.ref``, make its steps (eager, or compiled: ``gmc.runtime.steps``), generate from the
    prompt, in the chat template when the config or the tokenizer says so. ``write`` gets the text as it is
    made: the prompt with the first token (a prompt the loop refuses prints nothing), unless a chat."""
    prompt = read_prompt(config)
    runnable, tokenizer, stops = load_generator(config)
    template = has_chat_template(tokenizer)
    chat = template if config.chat is None else config.chat
    if chat and not template:
        raise GmcError(f"--chat: the tokenizer of {config.ref} has no chat template; leave out --chat to continue "
                       f"the prompt as text")
    ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}]) if chat else _encode(tokenizer, prompt)
    stream = None if write is None else TextStream(tokenizer, write, None if chat else ids[0])
    with runnable.steps(config.max_len or ids.shape[1] + config.sample.max_new_tokens, config.compile) as run:
        generation = generate(run.steps, run.cache, ids, config.sample, stops, stream and stream.add)
    if stream is not None:
        stream.end()
    if chat:
        return Generated(tokenizer.decode(generation.tokens, skip_special_tokens=True), generation, run.how, True)
    return Generated(_decode(tokenizer, ids, generation), generation, run.how)


def read_prompt(config: GenerateConfig) -> Optional[str]:
    """The prompt: ``--prompt``, or the text of ``--prompt-file``, either ``-`` reading stdin; a last line
    end is dropped (files and ``echo`` end with one), an empty text refused."""
    source = config.prompt_file if config.prompt_file is not None else "-" if config.prompt == "-" else None
    if source is None:
        return config.prompt
    import sys
    from pathlib import Path

    where = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as error:
        raise GmcError(f"cannot read --prompt-file {source}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise GmcError(f"the prompt in {where} is not UTF-8 text ({error.reason} at byte {error.start})") from error
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise GmcError(f"empty prompt in {where}")
    return text


def load_generator(config: GenerateConfig):
    """``(runnable, tokenizer, stop ids)`` of ``config.ref`` (``gmc.runtime.steps``), on ``config.threads``."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    from gmc.runtime.steps import load_runnable

    runnable = load_runnable(config.ref, config.dtype, config.device, config.model, config.trust_remote_code)
    tokenizer = runnable.tokenizer
    if tokenizer is None:
        raise GmcError(f"{config.ref} has no tokenizer: gmc generate needs one to encode the prompt")
    compiled = runnable.compiled
    if compiled is not None and config.max_len is not None and config.max_len != compiled.max_len:
        raise GmcError(f"--max-len {config.max_len}: {config.ref} runs programs compiled for {compiled.max_len} "
                       f"positions (gmc lower --compile --max-len N)")
    if runnable.model is not None:
        generation_config = getattr(runnable.model, "generation_config", None)
    else:
        from transformers import GenerationConfig

        try:
            generation_config = GenerationConfig.from_pretrained(config.ref)
        except OSError:  # no generation_config.json: the tokenizer's eos alone
            generation_config = None
    return runnable, tokenizer, stop_ids(tokenizer, generation_config)


def _encode(tokenizer, prompt: str) -> torch.Tensor:
    return torch.tensor([tokenizer(prompt)["input_ids"]], dtype=torch.long)  # [1, P]


def _decode(tokenizer, ids: torch.Tensor, generation: Generation) -> str:
    return tokenizer.decode(ids[0].tolist() + generation.tokens, skip_special_tokens=True)


def run_chat(config, read: Callable[[str], str] = input, write: Callable[[str], None] = write_stdout,
             note: Callable[[str], None] = write_stderr) -> list[dict]:
    """``gmc generate -i`` (``config``: a ``GenerateConfig``): load the ref once, make its steps over one
    cache, ``converse``; ``--prompt`` or ``--prompt-file``, when given, is the first message."""
    first = read_prompt(config)
    runnable, tokenizer, stops = load_generator(config)
    if not has_chat_template(tokenizer):
        raise GmcError(f"-i chats in the tokenizer's chat template, and the tokenizer of {config.ref} has none")
    text_config = runnable.config.get_text_config() if hasattr(runnable.config, "get_text_config") else runnable.config
    limit = getattr(text_config, "max_position_embeddings", None) or CHAT_MAX_LEN
    with runnable.steps(config.max_len or min(CHAT_MAX_LEN, limit), config.compile) as run:
        def reply(ids: torch.Tensor, on_token: Callable[[int], None]):
            return generate(run.steps, run.cache, ids, config.sample, stops, on_token)

        return converse(reply, tokenizer, run.cache.max_len, config.sample.max_new_tokens, read, write, note, first)
