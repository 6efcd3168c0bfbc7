"""The full head's update from its gradient's factors (``gmc.masks.rank_one``) is torch's AdamW."""
import copy

import pytest
import torch

from gmc.masks.harness import adamw
from gmc.masks.hypernet import HyperNetwork
from gmc.masks.rank_one import RankOneAdamW

GRIDS = [(3, 5), (8, 2), (1, 7)]
SETTINGS = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _pair():
    """The same hypernetwork twice: one on torch's AdamW, one on the rank-one update."""
    dense = HyperNetwork(GRIDS)
    rank_one = copy.deepcopy(dense)
    return (dense, adamw(list(dense.parameters()), "cpu", False, **SETTINGS),
            rank_one, adamw(list(rank_one.parameters()), "cpu", False, rank_one.rank_one_heads(), **SETTINGS))


def _step(source, optimizer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = source()
    optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(logits, [torch.randn(l.shape, generator=gen) for l in logits])
    optimizer.step()


def _assert_same(a, b, exact=False):
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_rank_one_update_is_adamw_and_resumes_exactly():
    dense, dense_opt, rank_one, rank_one_opt = _pair()
    assert isinstance(rank_one_opt, RankOneAdamW) and not isinstance(dense_opt, RankOneAdamW)
    for seed in range(3):
        _step(dense, dense_opt, seed)
        _step(rank_one, rank_one_opt, seed)
        assert rank_one_opt._compiled is not None  # the compiled update ran
        _assert_same(dense, rank_one)
    head = rank_one.heads[0].weight
    assert head.grad is None  # the weight gradient was never written out
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(rank_one_opt.state[head][key], dense_opt.state[dense.heads[0].weight][key])

    # a checkpoint of the rank-one run resumes it exactly, and torch's AdamW loads it too
    resumed = copy.deepcopy(rank_one)
    resumed.load_state_dict(rank_one.state_dict())
    resumed_opt = adamw(list(resumed.parameters()), "cpu", False, resumed.rank_one_heads(), **SETTINGS)
    checkpoint = copy.deepcopy(rank_one_opt.state_dict())  # as from disk: no tensor shared with the run
    resumed_opt.load_state_dict(copy.deepcopy(checkpoint))
    dense_opt.load_state_dict(copy.deepcopy(checkpoint))
    dense.load_state_dict(rank_one.state_dict())
    for seed in (3, 4):
        _step(rank_one, rank_one_opt, seed)
        _step(resumed, resumed_opt, seed)
        _step(dense, dense_opt, seed)
    _assert_same(rank_one, resumed, exact=True)
    _assert_same(dense, rank_one)


def test_a_failed_compile_writes_the_gradients_out_for_adamw(monkeypatch, capsys):
    def broken(fn, **_):
        def call(*args):
            raise RuntimeError("InductorError: no working C++ compiler\nmore")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    dense, dense_opt, rank_one, rank_one_opt = _pair()
    for seed in range(2):
        _step(dense, dense_opt, seed)
        _step(rank_one, rank_one_opt, seed)
    assert rank_one_opt._compiled is None
    _assert_same(dense, rank_one)
    assert "compiling the head's rank-one update failed (InductorError: no working C++ compiler)" in \
        capsys.readouterr().out + capsys.readouterr().err
    assert all(p.grad is None for p in (h.weight for h in rank_one.heads))


def test_rank_one_heads_give_the_features_their_gradient():
    """The GRU and norm see the same gradient through the factored heads as through nn.Linear."""
    dense = HyperNetwork(GRIDS)
    factored = copy.deepcopy(dense)
    heads, factors = factored.rank_one_heads()
    grads = [torch.randn(g) for g in GRIDS]
    torch.autograd.backward(dense(), grads)
    torch.autograd.backward(factored(), grads)
    for (name, a), b in zip(dense.named_parameters(), factored.parameters()):
        if name.startswith("heads."):
            g, f = factors[heads[id(b)]]
            torch.testing.assert_close(torch.outer(g, f), a.grad)
            assert b.grad is None
        else:
            torch.testing.assert_close(b.grad, a.grad)


def test_rank_one_needs_the_full_head():
    with pytest.raises(ValueError, match="full head"):
        HyperNetwork(GRIDS, head="lowrank").rank_one_heads()
