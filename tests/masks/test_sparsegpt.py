"""SparseGPT: the OBS update against direct least squares, masks, tiny models, SmolLM2 end to end."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import CharTokenizer, tiny_model

from gmc.errors import GmcError
from gmc.graph.targets import TargetFilter
from gmc.groups import GroupSpec, NMSpec, kept_params, layer_sparsity, parse_pattern
from gmc.inputs.model import LoadedModel
from gmc.masks.obs import (
    FixedChooser,
    GroupChooser,
    NMChooser,
    block_size,
    damped_hessian,
    inverse_cholesky,
    obs_sweep,
    prune_linear,
    reconstruct_linear,
)
from gmc.masks.sparsegpt import reconstruct, sparsegpt_prune


def _layer_problem(d_out=8, d_in=24, tokens=200, seed=0):
    """Weights ``[d_out, d_in]``, correlated inputs ``X [tokens, d_in]`` and ``H = 2 X^T X / tokens``."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g)
    mix = torch.randn(d_in, d_in, generator=g) / math.sqrt(d_in) + torch.eye(d_in)
    X = torch.randn(tokens, d_in, generator=g) @ mix
    return W, X, 2 * X.T @ X / tokens


def _least_squares(W, H, keep):
    """Per row: ``argmin_v (v - w) H (v - w)^T`` with ``v`` zero off ``keep`` (float64)."""
    W, H = W.double(), H.double()
    out = torch.zeros_like(W)
    for r in range(W.shape[0]):
        k, p = keep[r], ~keep[r]
        out[r, k] = W[r, k] + torch.linalg.solve(H[k][:, k], H[k][:, p] @ W[r, p])
    return out


@torch.no_grad()
def _obs_sweep_columns(weight, U, choose, block: int, strip: int):
    """Reference twin of ``obs_sweep``: the column-by-column loop of the SparseGPT paper (slow)."""
    W = weight.float().clone()  # [d_out, d_in]
    d_in = W.shape[1]
    pruned_all = torch.zeros_like(W, dtype=torch.bool)
    for i1 in range(0, d_in, block):
        i2 = min(i1 + block, d_in)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]  # [d_out, c], [c, c]
        diag = U1.diagonal()  # [c]
        pruned = torch.zeros_like(W1, dtype=torch.bool)
        errors = torch.zeros_like(W1)  # [d_out, c]
        for i in range(i2 - i1):
            if i % strip == 0:
                pruned[:, i:i + strip] = choose(i1 + i, W1[:, i:i + strip], diag[i:i + strip])
            err = torch.where(pruned[:, i], W1[:, i], 0.0) / diag[i]  # [d_out]
            W1[:, i:].sub_(err[:, None] * U1[i, i:][None, :])
            W1[:, i].masked_fill_(pruned[:, i], 0.0)
            errors[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:].sub_(errors @ U[i1:i2, i2:])
        pruned_all[:, i1:i2] = pruned
    return W, pruned_all


def _output_error(W_new, W, H):
    delta = (W_new - W).double()
    return float(torch.einsum("ri,ij,rj->", delta, H.double(), delta))


# ---------------------------------------------------------------- one linear


@pytest.mark.parametrize("damp", [0.0, 0.01])
def test_sweep_equals_least_squares_when_pruned_precede_kept(damp):
    W, X, H = _layer_problem()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(1, W.shape[1] - 1, (W.shape[0],), generator=g)  # pruned columns per row
    keep = torch.arange(W.shape[1])[None, :] >= prefix[:, None]  # [d_out, d_in]
    updated = reconstruct_linear(W, H, keep, damp=damp, refine_steps=0)
    expected = _least_squares(W, damped_hessian(H, damp)[0], keep)
    assert torch.allclose(updated.double(), expected, atol=2e-4, rtol=1e-3)
    assert torch.all(updated[~keep] == 0)


def test_sweep_alone_only_moves_weights_to_the_right():
    """Keep column 0, prune column 1: the sweep cannot compensate; least squares can."""
    W = torch.tensor([[1.0, 1.0]])
    H = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    keep = torch.tensor([[True, False]])
    swept = reconstruct_linear(W, H, keep, damp=0.0, refine_steps=0)
    assert torch.equal(swept, torch.tensor([[1.0, 0.0]]))
    exact = reconstruct_linear(W, H, keep, damp=0.0, refine_steps=4)
    assert torch.allclose(exact, torch.tensor([[1.5, 0.0]]))


@pytest.mark.parametrize("damp", [0.0, 0.01])
def test_refined_reconstruction_equals_least_squares_for_any_mask(damp):
    W, X, H = _layer_problem()
    keep = torch.rand(W.shape, generator=torch.Generator().manual_seed(2)) > 0.5
    swept = reconstruct_linear(W, H, keep, damp=damp, refine_steps=0)
    exact = reconstruct_linear(W, H, keep, damp=damp, refine_steps=64)
    H_damped = damped_hessian(H, damp)[0]
    expected = _least_squares(W, H_damped, keep)
    assert torch.allclose(exact.double(), expected, atol=2e-4, rtol=1e-3)
    assert torch.all(exact[~keep] == 0) and torch.all(swept[~keep] == 0)
    masked = _output_error(W * keep, W, H_damped)
    assert _output_error(expected, W, H_damped) <= _output_error(swept, W, H_damped) < masked


@pytest.mark.parametrize("group", ["1x1", "1x8", "2x5", "2:4", "given"])
def test_strip_solve_equals_the_column_loop(group):
    W, _, H = _layer_problem(d_out=12, d_in=40)
    H, dead = damped_hessian(H)
    U = inverse_cholesky(H)

    def chooser():
        if group == "given":
            return FixedChooser(torch.rand(W.shape, generator=torch.Generator().manual_seed(3)) > 0.4)
        pattern = parse_pattern(group)
        if isinstance(pattern, NMSpec):
            return NMChooser(pattern, dead)
        return GroupChooser(pattern, tuple(W.shape), 0.5, dead)

    pattern = parse_pattern("2:4" if group == "2:4" else "1x8" if group == "given" else group)
    block = 16 if group == "given" else block_size(pattern, base=16)
    strip = pattern.m if isinstance(pattern, NMSpec) else block
    fast, fast_pruned = obs_sweep(W, U, chooser(), block, strip)
    slow, slow_pruned = _obs_sweep_columns(W, U, chooser(), block, strip)
    assert torch.equal(fast_pruned, slow_pruned)
    assert torch.allclose(fast, slow, atol=1e-5, rtol=1e-4)
    assert torch.all(fast[fast_pruned] == 0)


def test_dead_inputs_are_pruned_first_and_kept_ones_untouched():
    W, X, _ = _layer_problem(d_in=16)
    X[:, 3] = 0.0
    H = 2 * X.T @ X / X.shape[0]
    updated, selectors = prune_linear(W, H, GroupSpec(1, 1), 0.25)
    assert not selectors[:, 3].any()  # saliency 0: pruned in every row
    keep = torch.ones_like(W, dtype=torch.bool)
    keep[:, 5] = False
    kept = reconstruct_linear(W, H, keep)
    assert torch.equal(kept[:, 3], W[:, 3])  # no information to update a dead input


@pytest.mark.parametrize("group,sparsity", [("1x1", 0.5), ("1x4", 0.5), ("1x5", 0.6), ("3x7", 0.5),
                                            ("1x200", 0.5), ("2:4", None), ("4:8", None)])
def test_prune_linear_masks_are_exact_and_meet_the_target(group, sparsity):
    W, _, H = _layer_problem(d_out=10, d_in=33 if "x" in group else 32)
    pattern = parse_pattern(group)
    updated, selectors = prune_linear(W, H, pattern, sparsity)
    shape = tuple(W.shape)
    keep = pattern.expand(selectors, shape)
    assert torch.all(updated[~keep] == 0)
    if isinstance(pattern, NMSpec):
        per_run = keep.reshape(shape[0], -1, pattern.m).sum(-1)
        assert torch.all(per_run == pattern.n)
    else:
        largest = int(pattern.group_sizes(shape).max())
        target = sparsity * shape[0] * shape[1]
        pruned = shape[0] * shape[1] - kept_params(pattern, selectors, shape)
        assert abs(pruned - target) <= largest


def test_a_target_is_never_emptied():
    W, _, H = _layer_problem(d_out=8, d_in=24)
    _, selectors = prune_linear(W, H, GroupSpec(8, 24), 0.99)
    assert selectors.sum() == 1


# ---------------------------------------------------------------- tiny models


def _calibration(seed=0, n=6, seq=48):
    return torch.randint(3, 300, (n, seq), generator=torch.Generator().manual_seed(seed))


def _loaded(arch="llama", **overrides):
    return LoadedModel(tiny_model(arch, **overrides), CharTokenizer(), f"tiny-{arch}")


def _magnitude_masks(model, pattern, sparsity=0.5):
    masks = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            scores = pattern.group_sum(module.weight.abs()).reshape(-1)
            keep = torch.zeros_like(scores, dtype=torch.bool)
            keep[scores.argsort(descending=True)[: round((1 - sparsity) * scores.numel())]] = True
            masks[name] = keep.reshape(pattern.grid(tuple(module.weight.shape)))
    return masks


def _target_inputs(model, names, blocks):
    """Inputs ``[tokens, d_in]`` of each named linear over the calibration blocks."""
    inputs = {name: [] for name in names}
    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(lambda m, a, o, n=n: inputs[n].append(a[0].reshape(-1, a[0].shape[-1])))
               for n in names]
    with torch.no_grad():
        for row in blocks:
            model(input_ids=row[None], use_cache=False)
    for handle in handles:
        handle.remove()
    return {n: torch.cat(x) for n, x in inputs.items()}


@pytest.mark.parametrize("arch,group,refine_steps", [("llama", "1x16", 0), ("llama", "1x16", 20), ("qwen3", "2x8", 0),
                                                    ("llama", "2:4", 20), ("mistral", "1x40", 0)])
def test_reconstruct_tiny_model(arch, group, refine_steps):
    pattern = parse_pattern(group)
    loaded = _loaded(arch)
    dense = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    masks = _magnitude_masks(loaded.model, pattern)
    blocks = _calibration()
    weights = reconstruct(loaded, masks, pattern, blocks, progress=False, refine_steps=refine_steps)
    assert set(weights) == set(masks)
    inputs = _target_inputs(loaded.model, masks, blocks)
    modules = dict(loaded.model.named_modules())
    for name, selectors in masks.items():
        shape = tuple(weights[name].shape)
        keep = pattern.expand(selectors, shape)
        assert torch.all(weights[name][~keep] == 0)
        assert torch.equal(modules[name].weight, weights[name])  # in place
        assert int((weights[name] != 0).sum()) <= kept_params(pattern, selectors, shape)  # sparsity kept
        W, X = dense[f"{name}.weight"], inputs[name]
        before = (X @ (W * keep).T - X @ W.T).norm()
        after = (X @ weights[name].T - X @ W.T).norm()
        assert after <= before * 1.0001, name


@pytest.mark.parametrize("arch,group", [("llama", "1x16"), ("qwen3", "2x8")])
def test_dense_target_reconstruction_fits_the_dense_model_outputs(arch, group):
    """Against the dense model's own inputs and outputs (``W X_d``), the dense-target fit beats the
    pruned-target (SparseGPT) fit at every target, and the model's final hidden states are closer."""
    pattern = parse_pattern(group)
    blocks = _calibration()
    reference = _loaded(arch)
    names = list(_magnitude_masks(reference.model, pattern))
    dense_inputs = _target_inputs(reference.model, names, blocks)
    dense_weights = {n: reference.model.get_submodule(n).weight.detach().clone() for n in names}
    with torch.no_grad():
        dense_out = torch.cat([reference.model.model(input_ids=row[None]).last_hidden_state for row in blocks])
    errors, final = {}, {}
    for target in ("pruned", "dense"):
        loaded = _loaded(arch)
        masks = _magnitude_masks(loaded.model, pattern)
        weights = reconstruct(loaded, masks, pattern, blocks, progress=False, refine_steps=20, target=target)
        inputs = _target_inputs(loaded.model, names, blocks)
        errors[target] = {n: float((inputs[n] @ weights[n].T - dense_inputs[n] @ dense_weights[n].T).norm())
                          for n in names}
        for n, selectors in masks.items():
            assert torch.all(weights[n][~pattern.expand(selectors, tuple(weights[n].shape))] == 0)
        with torch.no_grad():
            out = torch.cat([loaded.model.model(input_ids=row[None]).last_hidden_state for row in blocks])
        final[target] = float((out - dense_out).norm())
    first = names[0]  # the first stage sees identical inputs in both: the same fit
    assert errors["dense"][first] == pytest.approx(errors["pruned"][first], rel=1e-3)
    assert sum(errors["dense"].values()) < sum(errors["pruned"].values())
    assert final["dense"] < final["pruned"], final


@pytest.mark.parametrize("arch,group,sparsity", [("llama", "2:4", None), ("qwen2", "4:8", 0.5),
                                                 ("llama", "1x1", 0.5), ("qwen3", "1x40", 0.5),
                                                 ("llama", "3x7", 0.6)])
def test_sparsegpt_tiny_model_is_exactly_structured(arch, group, sparsity):
    pattern = parse_pattern(group)
    loaded = _loaded(arch)
    selectors, weights = sparsegpt_prune(loaded, pattern, sparsity, _calibration(), progress=False)
    assert len(selectors) == 2 * 7 and set(selectors) == set(weights)
    target = pattern.sparsity if isinstance(pattern, NMSpec) else sparsity
    for name, sel in selectors.items():
        shape = tuple(weights[name].shape)
        keep = pattern.expand(sel, shape)
        assert torch.all(weights[name][~keep] == 0)
        if isinstance(pattern, NMSpec):
            assert torch.all(keep.reshape(shape[0], -1, pattern.m).sum(-1) == pattern.n)
        else:
            largest = int(pattern.group_sizes(shape).max())
            assert abs(layer_sparsity(pattern, sel, shape) - target) * shape[0] * shape[1] <= largest


def test_sparsegpt_include_ignore_and_errors():
    loaded = _loaded()
    selectors, _ = sparsegpt_prune(loaded, "1x8", 0.5, _calibration(), TargetFilter(r"mlp\.", r"down_proj$"),
                                   progress=False)
    assert sorted(n.rsplit(".", 1)[1] for n in selectors) == ["gate_proj", "gate_proj", "up_proj", "up_proj"]
    with pytest.raises(GmcError, match="divisible"):
        sparsegpt_prune(_loaded(), "3:7", None, _calibration(), progress=False)
    with pytest.raises(GmcError, match="fixes sparsity"):
        sparsegpt_prune(_loaded(), "2:4", 0.3, _calibration(), progress=False)
    with pytest.raises(GmcError, match="sparsity"):
        sparsegpt_prune(_loaded(), "1x8", 1.0, _calibration(), progress=False)
    with pytest.raises(GmcError, match="regex"):
        sparsegpt_prune(_loaded(), "1x8", 0.5, _calibration(), TargetFilter("("), progress=False)


def test_sparsegpt_beats_magnitude_on_the_calibration_loss():
    blocks = _calibration(n=8)
    pattern = GroupSpec(1, 8)
    baseline = _loaded()
    baseline_masks = _magnitude_masks(baseline.model, pattern)
    for name, module in baseline.model.named_modules():
        if name in baseline_masks:
            module.weight.mul_(pattern.expand(baseline_masks[name], tuple(module.weight.shape)))
    pruned = _loaded()
    sparsegpt_prune(pruned, pattern, 0.5, blocks, progress=False)
    assert _loss(pruned.model, blocks) < _loss(baseline.model, blocks)


def _loss(model, blocks):
    with torch.no_grad():
        logits = model(input_ids=blocks, use_cache=False).logits[:, :-1]
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)))


# ---------------------------------------------------------------- the bundled model


@pytest.mark.slow
def test_sparsegpt_2_4_smollm2_end_to_end(smollm2):
    import copy

    from gmc.inputs.calib import load_texts, token_blocks

    loaded = LoadedModel(copy.deepcopy(smollm2.model), smollm2.tokenizer, smollm2.ref)
    lines, _ = load_texts("bundled")
    blocks = token_blocks(loaded.tokenizer, lines, seq_len=128, nsamples=8, seed=42)
    held, _ = load_texts("bundled-heldout")
    evaluation = token_blocks(loaded.tokenizer, held, seq_len=128, nsamples=4, seed=0)
    dense_loss = _loss(smollm2.model, evaluation)
    selectors, weights = sparsegpt_prune(loaded, "2:4", None, blocks, progress=False)
    assert len(selectors) == 30 * 7
    for name, keep in selectors.items():
        assert torch.all(keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2)
        assert torch.all(weights[name][~keep] == 0)
    pruned_loss = _loss(loaded.model, evaluation)
    assert math.isfinite(pruned_loss) and dense_loss < pruned_loss < dense_loss + 2.0
