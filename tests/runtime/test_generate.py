"""gmc's generation loop (``gmc.runtime.generate``): greedy tokens equal HF ``generate`` (with a repetition
penalty too), eos ids stop, seeded sampling repeats, top-p and the repetition penalty on hand-made logits, the
per-token callback, configs and cache sizes are checked, and the one-line summary."""
import pytest
import torch
from conftest import tiny_model

from gmc.errors import GmcError
from gmc.graph.decode import CachedLM, KVCache
from gmc.runtime.generate import Generation, SampleConfig, choose, generate, nucleus, penalize_repeats


class Recording:
    """A step that records the token count and position of each call, then runs ``CachedLM``."""

    def __init__(self, model):
        self.step, self.calls = CachedLM(model), []

    def __call__(self, ids, position, keys, values):
        self.calls.append((ids.shape[1], int(position)))
        return self.step(ids, position, keys, values)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _prompt(model, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def _run(model, ids, config, max_len: int = 32, eos=None):
    step = CachedLM(model)
    return generate({"prefill": step, "decode": step}, KVCache.empty(model.config, max_len), ids, config, eos)


def test_greedy_tokens_equal_hf_generate(model):
    ids = _prompt(model, 6)
    result = _run(model, ids, SampleConfig(max_new_tokens=12))
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, 6:].tolist()
    assert len(reference) == 12
    assert result.tokens == reference
    assert result.prompt_tokens == 6 and len(result.decode_s) == 11 and result.prefill_s > 0


def test_steps_get_the_prompt_once_then_one_token_per_position(model):
    prefill, decode = Recording(model), Recording(model)
    result = generate({"prefill": prefill, "decode": decode}, KVCache.empty(model.config, 16), _prompt(model, 5),
                      SampleConfig(max_new_tokens=4))
    assert prefill.calls == [(5, 0)]
    assert decode.calls == [(1, 5), (1, 6), (1, 7)]  # the last token needs no step
    assert len(result.tokens) == 4


def test_one_token_prompt_runs_the_decode_step(model):
    prefill, decode = Recording(model), Recording(model)
    ids = _prompt(model, 1)
    result = generate({"prefill": prefill, "decode": decode}, KVCache.empty(model.config, 8), ids,
                      SampleConfig(max_new_tokens=3))
    assert prefill.calls == [] and decode.calls == [(1, 0), (1, 1), (1, 2)]
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                               pad_token_id=0)[0, 1:].tolist()
    assert result.tokens == reference


def test_eos_stops_early(model):
    ids = _prompt(model, 4)
    greedy = _run(model, ids, SampleConfig(max_new_tokens=10)).tokens
    eos = greedy[3]
    first = greedy.index(eos)
    stopped = _run(model, ids, SampleConfig(max_new_tokens=10), eos=eos)
    assert stopped.tokens == greedy[:first + 1] and stopped.tokens[-1] == eos
    assert len(stopped.tokens) < 10 and len(stopped.decode_s) == first


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(model):
    ids = _prompt(model, 5)
    sampled = SampleConfig(max_new_tokens=16, temperature=2.0, seed=7)
    first, again = _run(model, ids, sampled).tokens, _run(model, ids, sampled).tokens
    assert first == again
    other = _run(model, ids, SampleConfig(max_new_tokens=16, temperature=2.0, seed=8)).tokens
    greedy = _run(model, ids, SampleConfig(max_new_tokens=16)).tokens
    assert other != first and first != greedy  # a random tiny model at T=2 is near uniform
    assert _run(model, ids, SampleConfig(max_new_tokens=16, temperature=2.0, top_k=1, seed=7)).tokens == greedy


def test_top_k_samples_only_among_the_k_likeliest(model):
    ids = _prompt(model, 5)
    with torch.no_grad():
        logits = CachedLM(model)(ids, torch.tensor(0), *_cache(model, 8))  # [1, V]
    likeliest = set(torch.topk(logits[0], 3).indices.tolist())
    firsts = {_run(model, ids, SampleConfig(max_new_tokens=1, temperature=5.0, top_k=3, seed=s)).tokens[0]
              for s in range(30)}
    assert firsts <= likeliest and len(firsts) > 1


def _cache(model, max_len):
    cache = KVCache.empty(model.config, max_len)
    return cache.keys, cache.values


@pytest.mark.parametrize("kwargs, word", [
    ({"max_new_tokens": 0}, "--max-new-tokens 0"),
    ({"temperature": -1.0}, "--temperature -1.0"),
    ({"temperature": float("nan")}, "--temperature nan"),
    ({"top_k": 0}, "--top-k 0"),
    ({"top_p": 0.0}, "--top-p 0.0"),
    ({"top_p": 1.5}, "--top-p 1.5"),
    ({"top_p": float("nan")}, "--top-p nan"),
    ({"repetition_penalty": 0.0}, "--repetition-penalty 0.0"),
    ({"repetition_penalty": -1.2}, "--repetition-penalty -1.2"),
    ({"repetition_penalty": float("inf")}, "--repetition-penalty inf"),
])
def test_sample_config_rejects_bad_values(kwargs, word):
    with pytest.raises(GmcError, match=word):
        SampleConfig(**kwargs)


def test_prompt_plus_new_tokens_beyond_the_cache_is_refused(model):
    with pytest.raises(GmcError, match=r"prompt of 6 tokens \+ max_new_tokens 11 exceeds the cache of 16"):
        _run(model, _prompt(model, 6), SampleConfig(max_new_tokens=11), max_len=16)
    assert len(_run(model, _prompt(model, 6), SampleConfig(max_new_tokens=10), max_len=16).tokens) == 10  # fits


def test_bad_prompt_shape_is_refused(model):
    for shape in ((1, 0), (2, 3), (3,)):
        ids = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(GmcError, match="prompt ids must be"):
            _run(model, ids, SampleConfig(max_new_tokens=2))


def test_summary_mentions_prefill_and_decode():
    line = Generation(prompt_tokens=4, tokens=[5, 6, 7], prefill_s=0.02, decode_s=[0.01, 0.03]).summary()
    assert line.startswith("prefill 4 tokens in 20.0 ms (200.0 tok/s)")
    assert "decode 2 tokens at 30.0 ms/token median (50.0 tok/s overall)" in line
    only_prefill = Generation(prompt_tokens=4, tokens=[5], prefill_s=0.02).summary()
    assert "prefill" in only_prefill and "decode" not in only_prefill


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    seen = torch.tensor([[0, 1, 1, 4]])  # token 1 twice: penalised once, as a set
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0, -8.0]])
    assert torch.equal(penalize_repeats(logits, seen, 2.0), expected)
    assert torch.equal(RepetitionPenaltyLogitsProcessor(2.0)(seen, logits.clone()), expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]]))  # the caller's logits stay
    # greedy picks token 3 only once token 0 (3.5 -> 1.75) is penalised
    assert int(choose(torch.tensor([[3.5, 0.0, 0.0, 3.0]]), SampleConfig(repetition_penalty=2.0),
                      torch.Generator(), torch.tensor([[0]]))) == 3
    assert int(choose(torch.tensor([[3.5, 0.0, 0.0, 3.0]]), SampleConfig(), torch.Generator(),
                      torch.tensor([[0]]))) == 0


@pytest.mark.parametrize("top_p, kept", [(0.4, {2}), (0.7, {2, 0}), (0.85, {2, 0, 3}), (0.99, {2, 0, 3, 1}),
                                         (1.0, {2, 0, 3, 1})])
def test_nucleus_keeps_the_likeliest_tokens_until_their_mass_reaches_p(top_p, kept):
    from transformers import TopPLogitsWarper

    probs = torch.tensor([[0.3, 0.05, 0.5, 0.15]])  # likelihood order 2, 0, 3, 1: mass before each 0, .5, .8, .95
    scores = probs.log()
    filtered = nucleus(scores, top_p)
    assert {i for i in range(4) if filtered[0, i] > float("-inf")} == kept
    assert torch.equal(filtered[0, sorted(kept)], scores[0, sorted(kept)])  # the kept scores are untouched
    assert torch.equal(filtered, TopPLogitsWarper(top_p)(torch.zeros(1, 1, dtype=torch.long), scores.clone()))
    firsts = {int(choose(scores, SampleConfig(temperature=1.0, top_p=top_p), torch.Generator().manual_seed(s)))
              for s in range(60)}
    assert firsts == kept  # sampling reaches every kept token and no other


def test_greedy_with_a_repetition_penalty_equals_hf_generate(model):
    ids = _prompt(model, 6)
    result = _run(model, ids, SampleConfig(max_new_tokens=12, repetition_penalty=1.5))
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               repetition_penalty=1.5, pad_token_id=0)[0, 6:].tolist()
    assert result.tokens == reference
    assert result.tokens != _run(model, ids, SampleConfig(max_new_tokens=12)).tokens  # the penalty matters here


def test_callback_sees_each_token_before_the_next_step_and_any_eos_id_stops(model):
    ids = _prompt(model, 4)
    greedy = _run(model, ids, SampleConfig(max_new_tokens=10)).tokens
    events = []
    decode = Recording(model)
    step = CachedLM(model)

    def on_token(token):
        events.append(("token", token, len(decode.calls)))

    result = generate({"prefill": step, "decode": decode}, KVCache.empty(model.config, 32), ids,
                      SampleConfig(max_new_tokens=10), eos_token_id=[999, greedy[4]], on_token=on_token)
    stop = greedy.index(greedy[4])
    assert result.tokens == greedy[:stop + 1]
    assert events == [("token", token, i) for i, token in enumerate(result.tokens)]  # token i before step i
