"""End-to-end CPU decode and prefill: compiled lowered vs compiled dense, both through one path.

Every compiled row is the same pipeline (``gmc.graph.pipeline.lower_decode`` -> ``gmc.formats.compiled``):
prefill and decode programs over a static KV cache, AOTInductor-compiled, driven by gmc's own
step loop; the lowered rows differ only by the lowering pass. HF eager dense (``model(...)`` with
its dynamic cache) is the second reference. The lowered and dense models hold the same masked
weights (random group masks, or ``--artifact`` masks), so speed depends only on what is read.

Per row: decode ms/token (median of interleaved steps: one step of each row in turn), prefill ms
for ``--prefill`` tokens (median, interleaved), the weight bytes one decode step reads, the
achieved weight-streaming GB/s, and that as a fraction of a memory-copy roofline measured in the
same run (``copy_`` of 256 MiB: bytes read + written over time, same threads). The KV cache
(attention reads the filled positions only) is not counted in the bytes. Every compiled row runs
its output head on gmc's kernel, all groups kept (``lower_decode``'s default; ``--no-head``: MKL's
GEMV in every row); ``--gmc-dense`` adds the strongest dense baseline, every projection on gmc's
kernel too.

    python bench/bench_decode.py --threads 1 2                  # SmolLM2-135M, 1x256 at 50%
    python bench/bench_decode.py --dtypes float32 bfloat16 --int8 --gmc-dense --ppl --artifact runs/gm/artifact
    python bench/bench_decode.py --model llama2-stack           # two LLaMA-2-7B decoder layers
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from gmc.formats.compiled import compile_programs, load_compiled
from gmc.graph.decode import KVCache
from gmc.graph.pipeline import LowerOptions, lower, lower_decode
from gmc.graph.targets import eager_targets
from gmc.groups import parse_pattern
from gmc.kernels.group_sparse_linear import cpu_backend
from gmc.kernels.linear import swap_group_sparse_linears
from gmc.kernels.packed import pack_dense, quantize_int8
from host import copy_bandwidth_gbs


@dataclass
class Row:
    label: str
    steps: dict  # prefill/decode callables
    weight_bytes: int
    baseline: str = "compiled dense"  # the row its speedups are measured against
    compile_s: float = 0.0
    decode_s: float = float("nan")
    prefill_s: float = float("nan")
    ppl: float = float("nan")


def all_kept(model: torch.nn.Module, names, pattern) -> dict:
    """Every named linear packed with all its groups kept (``pack_dense``): a dense layer in the
    packed layout, so ``quantize_int8`` of it is dense int8 weight-only on the same kernel and the
    same scale granularity (one per row and input block) as the lowered int8 rows. The rival
    torch ships, ``aten._weight_int8pack_mm``, is not the baseline: on this AVX2 CPU it runs a
    SmolLM2 MLP GEMV 4x slower than fp32 ``F.linear`` (docs/lowering.md)."""
    linears = {name: model.get_submodule(name) for name in names}
    return {name: pack_dense(linear.weight.detach(), pattern, linear.bias) for name, linear in linears.items()}


def weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every linear, int8 linear and packed layer (values,
    rows, scales); the embedding table is only gathered (one row)."""
    from gmc.kernels.linear import GroupSparseLinear

    total = 0
    for module in model.modules():
        if isinstance(module, GroupSparseLinear):
            total += sum(t.numel() * t.element_size() for t in (module.values, module.row_idx, module.scales)
                         if t is not None)
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def llama2_stack() -> torch.nn.Module:
    """Two decoder layers with LLaMA-2-7B shapes (random weights) and a 256-token vocabulary, so
    the projections are what decode reads (bytes bound 2x at 50%)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def load(name: str) -> tuple[torch.nn.Module, object, str]:
    """``(model, tokenizer or None, label)``."""
    from gmc.inputs.model import load_model

    if name == "llama2-stack":
        return llama2_stack(), None, "2 LLaMA-2-7B decoder layers (random)"
    loaded = load_model(name)
    return loaded.model, loaded.tokenizer, name


def masks_for(model, pattern, sparsity: float, artifact: str | None, seed: int = 0) -> dict:
    if artifact:
        from gmc.formats.artifact import load_artifact

        return load_artifact(artifact).masks
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.rand(pattern.grid(t.shape), generator=gen) >= sparsity for t in eager_targets(model)}


def compiled_row(label: str, model, packed: dict, max_len: int, scratch: str, weight_bytes: int, head: bool,
                 fuse: bool = LowerOptions.fuse) -> Row:
    start = time.perf_counter()
    programs = lower_decode(model, packed, max_len, LowerOptions(head=head, fuse=fuse))
    directory = f"{scratch}/{label.replace(' ', '-')}"
    compile_programs(programs, directory, max_len)
    compiled = load_compiled(directory)
    return Row(label, compiled.steps, weight_bytes, compile_s=time.perf_counter() - start)


class _EagerHF:
    """HF eager forward with its own dynamic cache, behind the step signature (position and
    gmc's static cache ignored): the reference a user of ``model.generate`` gets."""

    def __init__(self, model):
        self.model, self.past = model, None

    def __call__(self, ids, position, keys, values):
        if int(position) == 0:
            self.past = None
        out = self.model(ids, past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[:, -1]


@torch.no_grad()
def time_decode(rows: list[Row], config, max_len: int, dtype, prompt: torch.Tensor, steps: int) -> None:
    """Median seconds per decode step of each row, one step of each row in turn."""
    state = {}
    for row in rows:
        cache = KVCache.empty(config, max_len, dtype)
        logits = row.steps["prefill"](prompt, torch.tensor(0), cache.keys, cache.values)
        state[row.label] = [cache, prompt.shape[1], logits.argmax(-1, keepdim=True)]
    times = {row.label: [] for row in rows}
    for _ in range(steps):
        for row in rows:
            cache, position, token = state[row.label]
            start = time.perf_counter()
            logits = row.steps["decode"](token, torch.tensor(position), cache.keys, cache.values)
            times[row.label].append(time.perf_counter() - start)
            state[row.label][1:] = [position + 1, logits.argmax(-1, keepdim=True)]
    for row in rows:
        row.decode_s = statistics.median(times[row.label][2:])


@torch.no_grad()
def time_prefill(rows: list[Row], config, max_len: int, dtype, ids: torch.Tensor, repeats: int) -> None:
    times = {row.label: [] for row in rows}
    caches = {row.label: KVCache.empty(config, max_len, dtype) for row in rows}
    for _ in range(repeats + 1):
        for row in rows:
            cache = caches[row.label]
            start = time.perf_counter()
            row.steps["prefill"](ids, torch.tensor(0), cache.keys, cache.values)
            times[row.label].append(time.perf_counter() - start)
    for row in rows:
        row.prefill_s = statistics.median(times[row.label][1:])


@torch.no_grad()
def time_split(packed: dict, head, dtype, repeats: int = 15) -> dict[str, float]:
    """Median ms of one token's projections (every packed op once, in model order, outside any
    program) and of the output head alone (``head``: its packed layer on the op, or its dense
    weight for ``F.linear``): what the lowered decode step spends reading weights."""
    from gmc.kernels.group_sparse_linear import group_sparse_linear

    def op(layer, x):
        return group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, layer.shape[0],
                                   layer.spec.g_in, layer.scales)

    inputs = {layer.shape[1]: torch.randn(1, layer.shape[1], dtype=dtype) for layer in packed.values()}
    if isinstance(head, torch.Tensor):
        x_head = torch.randn(1, head.shape[1], dtype=dtype)
        run_head = lambda: torch.nn.functional.linear(x_head, head)  # noqa: E731
    else:
        head = head if head.scales is not None else head.to(dtype=dtype)
        x_head = torch.randn(1, head.shape[1], dtype=dtype)
        run_head = lambda: op(head, x_head)  # noqa: E731
    times = {"projections": [], "lm_head": []}
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in packed.values():
            op(layer, inputs[layer.shape[1]])
        middle = time.perf_counter()
        run_head()
        times["projections"].append(middle - start)
        times["lm_head"].append(time.perf_counter() - middle)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def copy_roofline(repeats: int = 7) -> float:
    """Memory-copy bandwidth in bytes/s (read + written) of a 256 MiB ``copy_``, median, on torch's threads."""
    return copy_bandwidth_gbs(torch.get_num_threads(), repeats) * 1e9


def bench(args, dtype_name: str, scratch: str) -> list[dict]:
    """Build and compile every row once, then time them at each of ``args.threads``."""
    dtype = getattr(torch, dtype_name)
    pattern = parse_pattern(args.group)
    model, tokenizer, model_label = load(args.model)
    masks = masks_for(model, pattern, args.sparsity, args.artifact)
    _, packed = lower(model, masks, pattern)  # packs the unmasked weights' kept groups
    dense = copy.deepcopy(model)
    for name, selectors in masks.items():  # the dense rows hold the same masked weights
        weight = dense.get_submodule(name).weight
        weight.mul_(pattern.expand(selectors.to(weight.dtype), tuple(weight.shape)))
    dense.to(dtype)
    model.to(dtype)
    packed = {name: layer.to(dtype=dtype) for name, layer in packed.items()}
    head = [name for name, module in dense.named_modules() if module is dense.get_output_embeddings()]
    # the output head as lower_decode(head=args.head) runs it, for each row's eager twin (bytes, perplexity)
    head_float = all_kept(dense, head, pattern) if args.head else {}
    # (label, the eager twin, the model lower_decode traces, packed layers)
    variants = [("compiled dense", swap_group_sparse_linears(copy.deepcopy(dense), head_float), dense, {}),
                ("compiled lowered", swap_group_sparse_linears(copy.deepcopy(model), {**packed, **head_float}), model,
                 packed)]
    if args.gmc_dense:  # the strongest dense baseline: every projection on gmc's kernel too, all groups kept
        dense_float = all_kept(dense, packed, pattern)
        variants.insert(1, ("compiled dense, gmc kernel",
                            swap_group_sparse_linears(copy.deepcopy(dense), {**dense_float, **head_float}), dense,
                            dense_float))
    if args.int8:  # every target and the lm_head int8 in both rows; dense keeps all groups
        head_int8 = {name: quantize_int8(layer) for name, layer in all_kept(dense, head, pattern).items()}
        dense_int8 = {name: quantize_int8(layer) for name, layer in all_kept(dense, packed, pattern).items()}
        lowered_int8 = {name: quantize_int8(layer) for name, layer in packed.items()}
        for label, traced, layers in (("compiled dense int8", dense, dense_int8), ("compiled lowered int8", model, lowered_int8)):
            twin = swap_group_sparse_linears(copy.deepcopy(traced), {**layers, **head_int8})
            variants.append((label, twin, traced, layers if args.head else {**layers, **head_int8}))
    max_len = max(args.prefill, args.prompt + args.new_tokens) + 8
    hf = _EagerHF(dense)
    rows = [Row("HF eager dense", {"prefill": hf, "decode": hf}, weight_bytes(dense))]
    for label, twin, traced, layers in variants:
        row = compiled_row(label, traced, layers, max_len, scratch, weight_bytes(twin), args.head, args.fuse)
        row.baseline = "compiled dense int8" if label == "compiled lowered int8" else "compiled dense"
        if args.ppl and tokenizer is not None:
            row.ppl = heldout_ppl(twin, tokenizer)
        rows.append(row)
    rows[0].ppl = rows[1].ppl
    gen = torch.Generator().manual_seed(1)
    vocab = dense.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    long_ids = torch.randint(0, vocab, (1, args.prefill), generator=gen)
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        time_decode(rows, dense.config, max_len, dtype, prompt, args.new_tokens)
        time_prefill(rows, dense.config, max_len, dtype, long_ids, args.prefill_repeats)
        results += _results(rows, copy_roofline(), model_label, threads, dtype_name)
        split = time_split(packed, next(iter(head_float.values()), dense.get_output_embeddings().weight), dtype)
        lowered = next(r for r in results[::-1] if r["row"] == "compiled lowered")
        results[-1]["split"] = {**split, "calls": len(packed),
                                "rest": lowered["decode_ms"] - split["projections"] - split["lm_head"]}
    return results


def heldout_ppl(model: torch.nn.Module, tokenizer) -> float:
    """Perplexity on the bundled held-out text, 512-token windows (docs/quality.md's protocol)."""
    from gmc.runtime.evaluate import perplexity

    return perplexity(model, tokenizer, "bundled-heldout", seq_len=512, progress=False).perplexity


def _results(rows, roofline, model_label, threads, dtype_name) -> list[dict]:
    by_label = {row.label: row for row in rows}
    results = []
    for row in rows:
        base = by_label[row.baseline]
        gbs = row.weight_bytes / row.decode_s / 1e9
        results.append({
            "model": model_label, "threads": threads, "dtype": dtype_name, "row": row.label,
            "decode_ms": row.decode_s * 1e3, "prefill_ms": row.prefill_s * 1e3, "weight_mib": row.weight_bytes / 2**20,
            "gb_s": gbs, "roofline_gb_s": roofline / 1e9, "of_roofline": gbs / (roofline / 1e9),
            "baseline": row.baseline, "decode_speedup": base.decode_s / row.decode_s,
            "prefill_speedup": base.prefill_s / row.prefill_s, "compile_s": row.compile_s,
            "bytes_bound": base.weight_bytes / row.weight_bytes, "ppl": row.ppl,
        })
    return results


def render(results: list[dict], args) -> str:
    lines = [f"{results[0]['model']}, {args.group} at {args.sparsity:.0%} "
             f"({'masks of ' + args.artifact if args.artifact else 'random masks'}), batch 1, "
             f"prompt {args.prompt}, {args.new_tokens} decode steps, prefill {args.prefill} tokens; "
             f"torch {torch.__version__}; op CPU path: {cpu_backend()}",
             "",
             "| threads | dtype | row | decode ms/token | tok/s | decode x base | prefill ms | prefill x base | "
             "weights MiB/step | bytes bound | GB/s | copy roofline GB/s | of roofline | held-out ppl |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['threads']} | {r['dtype']} | {r['row']} | {r['decode_ms']:.1f} | {1e3 / r['decode_ms']:.1f} | "
                     f"{r['decode_speedup']:.2f}x | {r['prefill_ms']:.0f} | {r['prefill_speedup']:.2f}x | "
                     f"{r['weight_mib']:.0f} | {r['bytes_bound']:.2f}x | {r['gb_s']:.1f} | {r['roofline_gb_s']:.1f} | "
                     f"{r['of_roofline']:.0%} | {r['ppl']:.2f} |")
    lines.append("")
    for r in results:
        if "split" in r:
            lines.append(f"compiled lowered decode, {r['threads']} thread(s) {r['dtype']}, ms/token: projections "
                         f"{r['split']['projections']:.1f} (the {r['split']['calls']} op calls alone, timed apart), lm_head {r['split']['lm_head']:.1f} "
                         f"(alone), rest {r['split']['rest']:.1f} (the step minus both: attention over the cache, "
                         f"norms, rotary, call overheads; approximate, the parts are timed outside the program)")
    lines.append("base: compiled dense for every row but compiled lowered int8, whose base is compiled dense int8; "
                 "bytes bound = base weight bytes / row weight bytes")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a HF ref, or llama2-stack")
    parser.add_argument("--group", default="1x256")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--artifact", default=None, help="use this masks artifact instead of random masks")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--prefill-repeats", type=int, default=5)
    parser.add_argument("--int8", action="store_true", help="also dense int8 weight-only and lowered int8 rows")
    parser.add_argument("--ppl", action="store_true", help="held-out perplexity of each row (bundled text, SmolLM2)")
    parser.add_argument("--head", action=argparse.BooleanOptionalAction, default=LowerOptions.head,
                        help="the output head on gmc's kernel, every group kept, in every compiled row "
                             "(lower_decode's head; default: gmc's)")
    parser.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=LowerOptions.fuse,
                        help="ops reading one input fused into one, and each gated MLP into one op "
                             "(lower_decode's fuse; default: fused)")
    parser.add_argument("--gmc-dense", action="store_true",
                        help="also a dense row with every projection on gmc's kernel (all groups kept)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="gmc-bench-decode-") as scratch:
        for dtype_name in args.dtypes:
            rows = bench(args, dtype_name, f"{scratch}/{dtype_name}")
            print(render(rows, args), "", sep="\n", flush=True)  # one table per dtype
            results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
