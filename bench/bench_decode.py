"""End-to-end CPU benchmark: lowered SmolLM2-135M vs the same model dense (masks folded).

Both models hold the same masked weights (random masks at ``--sparsity`` with ``--group``;
speed depends only on what is kept). Decode: greedy steps with the HF KV cache after a 32-token
prompt, median per-token latency -> tokens/s. Prefill: one forward over ``--prefill`` tokens.
Also printed: which CPU implementation of the op runs, and the Amdahl bound of decode from the
weight bytes read per token (the tied ``lm_head`` and the embeddings/norms are not pruned),
with the measured time of the ``lm_head`` GEMV alone.

    python bench/bench_decode.py --threads 1
    python bench/bench_decode.py --threads 2 --group 1x64
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch

from gmc.groups import GroupSpec
from gmc.kernels.group_sparse_linear import cpu_backend
from gmc.lowered import GroupSparseLinear, pack_model, swap_group_sparse_linears

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DecodeBench:
    group: str = "1x256"
    sparsity: float = 0.5
    prompt: int = 32
    new_tokens: int = 48
    prefill: int = 256
    prefill_repeats: int = 5

    def __post_init__(self):
        if not 0.0 <= self.sparsity < 1.0 or self.new_tokens < 1 or self.prefill < 2:
            raise ValueError("need 0 <= sparsity < 1, new_tokens >= 1, prefill >= 2")


@torch.no_grad()
def interleaved_decode(models: dict, prompt_ids: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Median seconds per greedy KV-cache step for each model, steps interleaved A, B, A, B...

    Interleaving spreads the noise of a shared machine evenly over the models compared.
    """
    state = {}
    for label, model in models.items():
        out = model(prompt_ids, use_cache=True)
        state[label] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
    times = {label: [] for label in models}
    for _ in range(new_tokens):
        for label, model in models.items():
            past, token = state[label]
            start = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            times[label].append(time.perf_counter() - start)
            state[label] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
    return {label: statistics.median(t) for label, t in times.items()}


@torch.no_grad()
def interleaved_prefill(models: dict, ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of one ``use_cache=False`` forward over ``ids`` per model, interleaved."""
    times = {label: [] for label in models}
    for label, model in models.items():
        model(ids[:, :8], use_cache=False)
    for _ in range(repeats):
        for label, model in models.items():
            start = time.perf_counter()
            model(ids, use_cache=False)
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


@torch.no_grad()
def decode_time_split(model: torch.nn.Module, prompt_ids: torch.Tensor, steps: int) -> dict[str, float]:
    """Median ms per decode step spent in the target projections, in the lm_head and elsewhere
    (attention, norms, rotary, HF Python), timed with forward hooks in a separate run."""
    spent = {"projections": 0.0, "lm_head": 0.0}
    head = model.get_output_embeddings()
    starts = {}

    def pre(module, _):
        starts[module] = time.perf_counter()

    def post(module, _, __):
        spent["lm_head" if module is head else "projections"] += time.perf_counter() - starts[module]

    hooked = [m for name, m in model.named_modules() if m is head or name.endswith(TARGETS)]
    handles = [h for m in hooked for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        out = model(prompt_ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        split = {"projections": [], "lm_head": [], "other": []}
        for _ in range(steps):
            spent.update(projections=0.0, lm_head=0.0)
            start = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            total = time.perf_counter() - start
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for key in ("projections", "lm_head"):
                split[key].append(spent[key])
            split["other"].append(total - spent["projections"] - spent["lm_head"])
    finally:
        for handle in handles:
            handle.remove()
    return {key: statistics.median(t) * 1e3 for key, t in split.items()}


def decode_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every linear (packed values + indices for lowered
    ones); the embedding table is only gathered (one row), the tied lm_head reads it whole."""
    total = 0
    for module in model.modules():
        if isinstance(module, GroupSparseLinear):
            total += module.packed().nbytes
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


@torch.no_grad()
def lm_head_ms(model: torch.nn.Module, steps: int) -> float:
    """Median ms of the lm_head GEMV [1, hidden] -> [1, vocab], its weight read from DRAM."""
    head = model.get_output_embeddings()
    x = torch.randn(1, head.in_features)
    flush = torch.zeros(256 << 18)  # 256 MB > L3
    times = []
    for _ in range(steps):
        flush.add_(1.0)
        start = time.perf_counter()
        head(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    from gmc.model import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", default=DecodeBench.group)
    parser.add_argument("--sparsity", type=float, default=DecodeBench.sparsity)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=DecodeBench.new_tokens)
    args = parser.parse_args()
    bench = DecodeBench(group=args.group, sparsity=args.sparsity, new_tokens=args.new_tokens)
    torch.set_num_threads(args.threads)
    spec = GroupSpec(*map(int, bench.group.split("x")))

    dense = load_model("smollm2-135m").model
    gen = torch.Generator().manual_seed(0)
    masks = {name: torch.rand(spec.grid(tuple(m.weight.shape)), generator=gen) >= bench.sparsity
             for name, m in dense.named_modules() if name.endswith(TARGETS)}
    for name, selectors in masks.items():
        weight = dense.get_submodule(name).weight
        weight.data *= spec.expand(selectors.float(), tuple(weight.shape))
    lowered = swap_group_sparse_linears(copy.deepcopy(dense), pack_model(dense, masks, spec))

    prompt = torch.randint(0, dense.config.vocab_size, (1, bench.prompt), generator=gen)
    long_ids = torch.randint(0, dense.config.vocab_size, (1, bench.prefill), generator=gen)
    with torch.no_grad():
        err = (lowered(prompt).logits - dense(prompt).logits).abs().max().item()
    models = {"dense": dense, "lowered": lowered}
    decode = interleaved_decode(models, prompt, bench.new_tokens)
    prefill = interleaved_prefill(models, long_ids, bench.prefill_repeats)
    print(f"SmolLM2-135M fp32, {bench.group} at {bench.sparsity:.0%} (random masks), {args.threads} thread(s), "
          f"torch {torch.__version__}; max |logit diff| lowered vs dense {err:.2e}")
    print(f"lowered op CPU path: {cpu_backend()}")
    print(f"| model | decode tok/s | decode ms/token | prefill {bench.prefill} tok ms |")
    print("|---|---|---|---|")
    for label in models:
        print(f"| {label} | {1 / decode[label]:.1f} | {decode[label] * 1e3:.1f} | {prefill[label] * 1e3:.0f} |")
    print(f"decode speedup {decode['dense'] / decode['lowered']:.2f}x, "
          f"prefill speedup {prefill['dense'] / prefill['lowered']:.2f}x")
    dense_bytes, lowered_bytes = decode_bytes(dense), decode_bytes(lowered)
    head = dense.get_output_embeddings().weight
    head_bytes = head.numel() * head.element_size()
    print(f"weight bytes per decode step: dense {dense_bytes / 2**20:.0f} MiB, lowered {lowered_bytes / 2**20:.0f} MiB "
          f"(lm_head {head_bytes / 2**20:.0f} MiB = {head_bytes / dense_bytes:.0%} of dense, not pruned); "
          f"memory-bound decode limit {dense_bytes / lowered_bytes:.2f}x; "
          f"lm_head GEMV alone {lm_head_ms(dense, 15):.1f} ms/token")
    print("decode time split, ms/token (forward hooks, separate run):")
    for label, model in models.items():
        split = decode_time_split(model, prompt, 16)
        print(f"  {label}: " + ", ".join(f"{key} {value:.1f}" for key, value in split.items()))


if __name__ == "__main__":
    main()
