"""Chat (``gmc.runtime.chat``): streamed text equals the final decode and never shows half a character,
the chat template and its stop ids, a conversation trimmed to the cache, and ``converse`` turn by turn
(scripted input, a stand-in reply and a tiny model with SmolLM2's tokenizer)."""
import pytest
import torch
from conftest import byte_bpe_tokenizer, smol_tokenizer, tiny_smol_model

from gmc.errors import GmcError
from gmc.graph.decode import CachedLM, KVCache
from gmc.runtime.chat import MARKER, TextStream, chat_ids, converse, fit_conversation, has_chat_template, stop_ids
from gmc.runtime.generate import Generation, SampleConfig, generate


@pytest.fixture(scope="module")
def tokenizer():
    return smol_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_smol_model()


def test_stream_holds_partial_characters_and_writes_the_decoded_text(tokenizer):
    text = "héllo wörld 日本語 ✓ ok"
    ids = tokenizer(text)["input_ids"]
    pieces = []
    stream = TextStream(tokenizer, pieces.append)
    for token in ids:
        stream.add(token)
    stream.end()
    assert len(pieces) > 5 and all("\ufffd" not in piece for piece in pieces)  # 日 is three byte tokens
    assert "".join(pieces) == text + "\n"


def test_streamed_generation_equals_the_final_decode(tokenizer, model):
    """Sampled tokens of a random model: bytes of split characters, newlines, special tokens."""
    prompt = torch.tensor([tokenizer("The cat")["input_ids"]])
    for seed in range(4):
        pieces, written_at = [], []
        stream = TextStream(tokenizer, lambda text: (pieces.append(text), written_at.append(len(result_tokens))))
        result_tokens = []

        def on_token(token):
            result_tokens.append(token)
            stream.add(token)

        step = CachedLM(model)
        result = generate({"prefill": step, "decode": step}, KVCache.empty(model.config, 64), prompt,
                          SampleConfig(max_new_tokens=40, temperature=1.0, seed=seed), on_token=on_token)
        stream.end()
        assert result.tokens == result_tokens
        assert "".join(pieces) == tokenizer.decode(result.tokens, skip_special_tokens=True) + "\n"
        assert len(set(written_at)) > 5  # written while tokens came, not all at the end


def test_stop_ids_take_the_tokenizer_eos_and_the_generation_config_ones(tokenizer):
    from transformers import GenerationConfig

    assert stop_ids(tokenizer) == {tokenizer.eos_token_id} == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert stop_ids(tokenizer, GenerationConfig(eos_token_id=[0, 7])) == {tokenizer.eos_token_id, 0, 7}
    assert stop_ids(tokenizer, GenerationConfig(eos_token_id=5)) == {tokenizer.eos_token_id, 5}


def test_chat_ids_are_the_template_with_the_assistant_turn_opened(tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = chat_ids(tokenizer, messages)
    assert ids.shape[0] == 1 and ids.dtype == torch.long
    text = tokenizer.decode(ids[0])
    assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert has_chat_template(tokenizer) and not has_chat_template(byte_bpe_tokenizer())


def _conversation(turns: int, system: bool = False) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i} " * 5},
                     {"role": "assistant", "content": f"answer {i} " * 5}]
    return messages + [{"role": "user", "content": "last one"}]


@pytest.mark.parametrize("system", [False, True])
def test_a_long_conversation_drops_its_oldest_exchanges_to_fit_the_cache(tokenizer, system):
    messages = _conversation(4, system)
    full = chat_ids(tokenizer, messages).shape[1]
    ids, kept = fit_conversation(tokenizer, messages, full + 8, 8)
    assert kept == messages and ids.shape[1] == full
    ids, kept = fit_conversation(tokenizer, messages, full + 7, 8)  # one position short: one exchange goes
    assert kept == messages[:int(system)] + messages[int(system) + 2:] and ids.shape[1] + 8 <= full + 7
    assert torch.equal(ids, chat_ids(tokenizer, kept))
    ids, kept = fit_conversation(tokenizer, messages, chat_ids(tokenizer, messages[:int(system)] + messages[-1:])
                                 .shape[1] + 8, 8)
    assert kept == messages[:int(system)] + messages[-1:]
    with pytest.raises(GmcError, match=r"the message takes \d+ tokens with the chat template, more than the 2 a "
                                       r"cache of 10 positions leaves beside --max-new-tokens 8"):
        fit_conversation(tokenizer, messages, 10, 8)


class Script:
    """``read`` for ``converse``: the given lines (an exception instance is raised), then end of input."""

    def __init__(self, *lines):
        self.lines, self.markers = list(lines), []

    def __call__(self, marker):
        self.markers.append(marker)
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line


def _fixed_reply(tokenizer, text: str, stop_after: int | None = None):
    """A stand-in ``reply``: streams the tokens of ``text`` then eos, recording the ids it was given;
    ``stop_after``: raises KeyboardInterrupt after that many tokens (Ctrl-C during the reply)."""
    seen = []

    def reply(ids, on_token):
        seen.append(ids)
        tokens = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        for i, token in enumerate(tokens):
            if stop_after is not None and i == stop_after:
                raise KeyboardInterrupt
            on_token(token)
        return Generation(prompt_tokens=ids.shape[1], tokens=tokens, prefill_s=0.01, decode_s=[0.01] * 3)

    return reply, seen


def test_converse_keeps_the_conversation_and_ends_at_end_of_input(tokenizer):
    reply, seen = _fixed_reply(tokenizer, "Hello, friend.")
    out, notes, read = [], [], Script("hi", "   ", "and again?")
    messages = converse(reply, tokenizer, 512, 16, read, out.append, notes.append)
    assert messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, friend."},
                        {"role": "user", "content": "and again?"},
                        {"role": "assistant", "content": "Hello, friend."}]
    assert read.markers == [MARKER] * 4  # two messages, one blank line, end of input
    assert "".join(out) == "Hello, friend.\n" * 2 + "\n"
    assert torch.equal(seen[1], chat_ids(tokenizer, messages[:3]))  # the second turn prefills everything
    assert len(notes) == 2 and all(note.startswith("prefill ") for note in notes)


def test_ctrl_c_at_the_marker_ends_and_during_a_reply_stops_only_that_reply(tokenizer):
    reply, _ = _fixed_reply(tokenizer, "one two three four five", stop_after=2)
    notes = []
    messages = converse(reply, tokenizer, 512, 16, Script("first", KeyboardInterrupt(), "never read"),
                        lambda text: None, notes.append)
    assert messages == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one two"}]
    assert notes == ["gmc: reply stopped\n"]
    stopped_at_once, _ = _fixed_reply(tokenizer, "one", stop_after=0)
    assert converse(stopped_at_once, tokenizer, 512, 16, Script("first"), lambda text: None, notes.append) == []


def test_a_message_longer_than_the_cache_is_refused_and_the_conversation_goes_on(tokenizer):
    reply, seen = _fixed_reply(tokenizer, "ok")
    notes = []
    short = chat_ids(tokenizer, [{"role": "user", "content": "short"}]).shape[1]
    messages = converse(reply, tokenizer, short + 4, 4, Script("word " * 50, "short"), lambda text: None,
                        notes.append, first=None)
    assert messages == [{"role": "user", "content": "short"}, {"role": "assistant", "content": "ok"}]
    assert notes[0].startswith("gmc: error: the message takes ") and len(seen) == 1


def test_converse_on_a_tiny_model_re_prefills_the_conversation_every_turn(tokenizer, model):
    cache = KVCache.empty(model.config, 256)
    step = CachedLM(model)
    sample = SampleConfig(max_new_tokens=6)
    prompts = []

    def reply(ids, on_token):
        prompts.append(ids)
        return generate({"prefill": step, "decode": step}, cache, ids, sample, stop_ids(tokenizer), on_token)

    out = []
    messages = converse(reply, tokenizer, cache.max_len, sample.max_new_tokens, Script("Hi"), out.append,
                        lambda text: None, first="Tell me a story")
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2 and messages[0]["content"] == "Tell me a story"
    assert torch.equal(prompts[1], chat_ids(tokenizer, messages[:3]))
    greedy = generate({"prefill": step, "decode": step}, KVCache.empty(model.config, 256), prompts[1], sample)
    assert messages[3]["content"] == tokenizer.decode(greedy.tokens, skip_special_tokens=True)  # same as a fresh cache
    assert "".join(out).startswith(messages[1]["content"])
