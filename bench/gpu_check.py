"""GPU readiness of the Triton group-sparse kernels, in one command.

    python bench/gpu_check.py                                 # on a CUDA GPU
    TRITON_INTERPRET=1 python bench/gpu_check.py --tiny       # on CPU: checks this script runs

Four sections, one after the other (``--sections`` picks some; one that raises is a failed row
and the others still run):

1. correctness: the Triton op against the dense reference ``F.linear(x, packed.unpack(), bias)``
   (computed in float64 from the same rounded inputs) over group shapes 1x256, 1x64, 32x32, a
   ragged ``d_in`` (576 with 1x256), a ragged 32x32 and a fully pruned layer; every layer also has
   an empty output group (rows with no kept weight) and an empty input block. One PASS/FAIL line
   per case with the max abs error and the max abs error over the largest reference magnitude;
   a case passes when ``|out - ref| <= atol + rtol * |ref|`` everywhere (per-dtype tolerances).
   The exit code is 1 when any case fails.
2. speed: the op vs cuBLAS dense ``F.linear`` on LLaMA-2-7B shapes, 1x256 groups, 50% random masks,
   median (p20-p80) ms from ``triton.testing.do_bench`` (L2 flushed before each call) and
   effective GB/s: bytes read and written (lowered: kept values + ``row_idx`` + ``row_ptr`` + x +
   y; dense: weight + x + y; the fp32 accumulator of the lowered op is not counted) over time.
3. end-to-end compiled decode: ``check_decode`` (dense vs lowered through gmc's one path); on CUDA
   it also fails when a compiled lowered step calls a gmc op (its Triton kernels must be in the package).
4. mask-learning steps: ``check_learning``, GroupMask 1x64 on a SmolLM2-135M-shaped Llama with
   random weights, 256-token blocks, bf16 on CUDA: eager at batch 1 and 4, compiled at batch 1;
   ms per step, tokens/s, the first step's time (the compile), peak memory.

On CUDA the correctness and speed rows call ``torch.ops.gmc.group_sparse_linear`` (what a lowered
model calls; its CUDA implementation is the Triton kernels). Under ``TRITON_INTERPRET=1`` without a
GPU the tensors live on CPU, where the op would run the CPU kernel, so the rows call
``triton_group_sparse_linear`` directly; ``--tiny`` then uses small shapes and a plain timer, and
its timings are interpreter timings, meaningless for speed. ``--json PATH`` writes every row so
docs can be regenerated from a run.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from bench_triton_op import TINY, bench_ms
from host import host
from shapes import LLAMA2_7B, Shape

from gmc.groups import GroupSpec
from gmc.kernels.packed import PackedLinear, pack

NO_DEVICE = "needs a CUDA GPU or TRITON_INTERPRET=1"
SECTIONS = ("correctness", "speed", "decode", "learn")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (atol, rtol) against the float64 reference; weights are scaled by d_in ** -0.5, so outputs are O(1).
# fp32 runs IEEE fp32 products; fp16/bf16 accumulate in fp32 and round once at the end (half an ulp:
# 4.9e-4 relative for fp16, 3.9e-3 for bf16).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}


@dataclass(frozen=True)
class Case:
    group: str
    shape: Shape
    sparsity: float  # fraction of groups pruned at random (plus one empty output group and input block)


CASES = (
    Case("1x256", LLAMA2_7B[0], 0.5),
    Case("1x64", LLAMA2_7B[0], 0.5),
    Case("32x32", LLAMA2_7B[0], 0.5),
    Case("1x256", LLAMA2_7B[2], 0.5),
    Case("1x256", Shape("ragged d_in 1536x576", 1536, 576), 0.5),
    Case("32x32", Shape("ragged 100x70", 100, 70), 0.5),
    Case("1x256", Shape("all pruned 512x1024", 512, 1024), 1.0),
)
TINY_CASES = (
    Case("1x256", Shape("ragged d_in 96x576", 96, 576), 0.5),
    Case("1x64", Shape("tiny 128x320", 128, 320), 0.5),
    Case("32x32", Shape("ragged 100x70", 100, 70), 0.5),
    Case("1x256", Shape("all pruned 64x512", 64, 512), 1.0),
)


@dataclass(frozen=True)
class Plan:
    """What one run measures; ``--tiny`` and the command-line overrides build it."""

    cases: tuple[Case, ...]
    check_tokens: tuple[int, ...]
    check_dtypes: tuple[str, ...]
    speed_shapes: tuple[Shape, ...]
    speed_tokens: tuple[int, ...]
    speed_dtypes: tuple[str, ...]
    speed_group: str = "1x256"
    speed_sparsity: float = 0.5

    def __post_init__(self):
        unknown = set(self.check_dtypes + self.speed_dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"unknown dtypes {sorted(unknown)}; choose from {sorted(DTYPES)}")
        if min(self.check_tokens + self.speed_tokens) < 1:
            raise ValueError("token counts must be >= 1")

    @classmethod
    def from_args(cls, args) -> Plan:
        dtypes = tuple(args.dtypes.split(",")) if args.dtypes else None
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
        if args.tiny:
            return cls(TINY_CASES, tokens or (1, 5, 33), dtypes or ("float32", "float16", "bfloat16"),
                       TINY, tokens or (1, 33), dtypes or ("float16", "bfloat16"))
        return cls(CASES, tokens or (1, 16, 256, 2048), dtypes or ("float32", "float16", "bfloat16"),
                   LLAMA2_7B, tokens or (1, 16, 256, 2048), dtypes or ("float16", "bfloat16"))


def _packed_layer(group: str, shape: Shape, sparsity: float, gen: torch.Generator, with_empty: bool) -> PackedLinear:
    """A random layer (fp32, CPU) with weights ``~ N(0, 1 / d_in)`` and a bias."""
    spec = GroupSpec(*map(int, group.split("x")))
    weight = torch.randn(shape.d_out, shape.d_in, generator=gen) * shape.d_in ** -0.5  # [d_out, d_in]
    bias = torch.randn(shape.d_out, generator=gen)  # [d_out]
    keep = torch.rand(spec.grid((shape.d_out, shape.d_in)), generator=gen) >= sparsity  # [G_out, G_in]
    if with_empty:
        keep[0] = False  # output rows with no kept group
        if keep.shape[1] > 1:
            keep[:, 1] = False  # an input block with no kept row
    return pack(weight, keep, spec, bias)


def _lowered_fn(device: str):
    """The call under test: the registered op on CUDA, the Triton wrapper itself on CPU."""
    if device == "cuda":
        import gmc.kernels.group_sparse_linear  # noqa: F401  (defines torch.ops.gmc.group_sparse_linear)

        return torch.ops.gmc.group_sparse_linear
    from gmc.kernels.triton_group_sparse import triton_group_sparse_linear

    return triton_group_sparse_linear


def check_correctness(plan: Plan, device: str, seed: int) -> list[dict]:
    """One row per (case, dtype, tokens): PASS/FAIL with max abs and max relative error."""
    lowered = _lowered_fn(device)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for case in plan.cases:
        layer = _packed_layer(case.group, case.shape, case.sparsity, gen, with_empty=True)
        for dtype_name in plan.check_dtypes:
            dtype = DTYPES[dtype_name]
            atol, rtol = TOLERANCES[dtype]
            p = layer.to(device=device, dtype=dtype)
            weight = p.unpack().double()  # [d_out, d_in] dense masked reference weight
            for tokens in plan.check_tokens:
                x = torch.randn(tokens, case.shape.d_in, generator=gen).to(device=device, dtype=dtype)  # [T, d_in]
                out = lowered(x, p.values, p.row_idx, p.row_ptr, p.bias, case.shape.d_out, p.spec.g_in)  # [T, d_out]
                ref = F.linear(x.double(), weight, p.bias.double())  # [T, d_out]
                err = (out.double() - ref).abs()
                ok = (out.dtype == dtype and out.shape == ref.shape and bool(torch.isfinite(out).all())
                      and bool((err <= atol + rtol * ref.abs()).all()))
                row = {
                    "group": case.group, "shape": case.shape.name, "d_out": case.shape.d_out,
                    "d_in": case.shape.d_in, "sparsity": case.sparsity, "kept": _kept_fraction(p),
                    "dtype": dtype_name, "tokens": tokens, "max_abs_err": err.max().item(),
                    "max_rel_err": (err.max() / ref.abs().max().clamp_min(1e-30)).item(),
                    "atol": atol, "rtol": rtol, "passed": ok,
                }
                rows.append(row)
                print(f"{'PASS' if ok else 'FAIL'}  {case.group:>5} {case.shape.name:<22} {dtype_name:<8} "
                      f"tokens={tokens:<5} max abs {row['max_abs_err']:.2e}  max rel {row['max_rel_err']:.2e}  "
                      f"(atol {atol:g}, rtol {rtol:g})", flush=True)
    return rows


def _kept_fraction(p: PackedLinear) -> float:
    return p.values.numel() / (p.shape[0] * p.shape[1])


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check_speed(plan: Plan, device: str, seed: int, interpret: bool) -> list[dict]:
    """Op vs dense ``F.linear`` per (shape, dtype, tokens): median ms, speedup, effective GB/s."""
    lowered = _lowered_fn(device)
    gen = torch.Generator().manual_seed(seed)
    timer = "interpreter (meaningless for speed)" if interpret else "triton.testing.do_bench"
    print(f"timings: {timer}; {plan.speed_group} groups, {plan.speed_sparsity:.0%} random masks")
    print("| shape | dtype | tokens | dense ms (p20-p80) | lowered ms (p20-p80) | dense/lowered | dense GB/s | lowered GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in plan.speed_shapes:
        layer = _packed_layer(plan.speed_group, shape, plan.speed_sparsity, gen, with_empty=False)
        for dtype_name in plan.speed_dtypes:
            dtype = DTYPES[dtype_name]
            p = layer.to(device=device, dtype=dtype)
            weight = p.unpack()  # [d_out, d_in] dense masked weight, for cuBLAS
            for tokens in plan.speed_tokens:
                x = torch.randn(tokens, shape.d_in, generator=gen).to(device=device, dtype=dtype)  # [T, d_in]
                run = partial(lowered, x, p.values, p.row_idx, p.row_ptr, None, shape.d_out, p.spec.g_in)
                y = run()  # autotunes outside the timed calls
                dense = bench_ms(partial(F.linear, x, weight), interpret)
                sparse = bench_ms(run, interpret)
                dense_bytes = _nbytes(weight, x, y)
                lowered_bytes = _nbytes(p.values, p.row_idx, p.row_ptr, x, y)
                row = {
                    "shape": shape.name, "d_out": shape.d_out, "d_in": shape.d_in, "group": plan.speed_group,
                    "sparsity": plan.speed_sparsity, "kept": _kept_fraction(p), "dtype": dtype_name,
                    "tokens": tokens, "timer": timer,
                    "dense_ms": dense[0], "dense_ms_p20": dense[1], "dense_ms_p80": dense[2],
                    "lowered_ms": sparse[0], "lowered_ms_p20": sparse[1], "lowered_ms_p80": sparse[2],
                    "speedup": dense[0] / sparse[0],
                    "dense_gbps": dense_bytes / dense[0] / 1e6, "lowered_gbps": lowered_bytes / sparse[0] / 1e6,
                }
                rows.append(row)
                print(f"| {shape.name} | {dtype_name} | {tokens} | {dense[0]:.3f} ({dense[1]:.3f}-{dense[2]:.3f}) "
                      f"| {sparse[0]:.3f} ({sparse[1]:.3f}-{sparse[2]:.3f}) | {row['speedup']:.2f}x "
                      f"| {row['dense_gbps']:.1f} | {row['lowered_gbps']:.1f} |", flush=True)
    return rows


def check_decode(args, device: str, interpret: bool) -> list[dict]:
    """End-to-end decode, dense vs lowered, through gmc's one path: ``lower_decode`` (prefill and
    decode programs over a static KV cache) -> AOTInductor (``gmc.formats.compiled``) -> gmc's step loop.

    On a GPU: two LLaMA-2-7B decoder layers (random weights, 256-token vocabulary so the
    projections are what decode reads), 1x256 random masks at 50%, bf16. Under ``--tiny`` a tiny
    Llama on CPU runs the same programs exported but not compiled (an AOTInductor build takes
    minutes): it checks the code path, not speed."""
    import statistics
    import tempfile
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from gmc.formats.compiled import compile_programs, load_compiled
    from gmc.graph.decode import KVCache
    from gmc.graph.pipeline import lower, lower_decode
    from gmc.graph.targets import eager_targets
    from gmc.groups import parse_pattern

    tiny = args.tiny
    dtype = torch.float32 if tiny else torch.bfloat16
    shape = (dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
             if tiny else dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32))
    pattern = parse_pattern("1x16" if tiny else "1x256")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, vocab_size=256, tie_word_embeddings=False)).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    gen = torch.Generator().manual_seed(args.seed)
    masks = {t.name: torch.rand(pattern.grid(t.shape), generator=gen) >= 0.5 for t in eager_targets(model)}
    _, packed = lower(model, masks, pattern)
    dense = copy.deepcopy(model)
    for name, selectors in masks.items():
        weight = dense.get_submodule(name).weight
        weight.mul_(pattern.expand(selectors.float(), tuple(weight.shape)))
    model.to(device=device, dtype=dtype)
    dense.to(device=device, dtype=dtype)
    packed = {name: layer.to(device=device, dtype=dtype) for name, layer in packed.items()}
    prompt_len, new_tokens = 8, (8 if tiny else 64)
    max_len = prompt_len + new_tokens + 1  # the timed steps, then one profiled step (_op_calls)
    steps = {}
    with tempfile.TemporaryDirectory(prefix="gmc-gpu-check-") as scratch:
        for label, source, layers in (("dense", dense, {}), ("lowered", model, packed)):
            programs = lower_decode(source, layers, max_len)
            if tiny:
                steps[label] = {name: program.module() for name, program in programs.items()}
            else:
                compile_programs(programs, f"{scratch}/{label}", max_len)
                steps[label] = load_compiled(f"{scratch}/{label}").steps
        prompt = torch.randint(0, 256, (1, prompt_len), generator=gen).to(device)
        state, times = {}, {label: [] for label in steps}
        with torch.no_grad():
            for label, step in steps.items():
                cache = KVCache.empty(dense.config, max_len, dtype, device)
                logits = step["prefill"](prompt, torch.tensor(0, device=device), cache.keys, cache.values)
                state[label] = [cache, prompt_len, logits]
            first = {label: state[label][2].float() for label in steps}
            for _ in range(new_tokens):
                for label, step in steps.items():
                    cache, position, logits = state[label]
                    token = logits.argmax(-1, keepdim=True)
                    _sync(device)
                    start = time.perf_counter()
                    logits = step["decode"](token, torch.tensor(position, device=device), cache.keys, cache.values)
                    _sync(device)
                    times[label].append(time.perf_counter() - start)
                    state[label] = [cache, position + 1, logits]
        cache, position, logits = state["lowered"]
        op_calls = _op_calls(steps["lowered"]["decode"], logits.argmax(-1, keepdim=True),
                             torch.tensor(position, device=device), cache.keys, cache.values)
    error = ((first["lowered"] - first["dense"]).abs().max() / first["dense"].abs().max()).item()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    ms = {label: statistics.median(t[2:]) * 1e3 for label, t in times.items()}
    row = {"section": "decode", "model": "tiny llama (exported, not compiled)" if tiny else "2 x LLaMA-2-7B layers",
           "dtype": str(dtype).removeprefix("torch."), "group": str(pattern), "dense_ms": ms["dense"],
           "lowered_ms": ms["lowered"], "speedup": ms["dense"] / ms["lowered"], "prefill_rel_error": error,
           "gmc_op_calls": op_calls, "passed": error <= tolerance and (tiny or op_calls == 0)}
    print(f"{'PASS' if row['passed'] else 'FAIL'} {row['model']} {row['dtype']} {row['group']}: prefill logits "
          f"rel error {error:.2e} (tol {tolerance:g}); decode dense {ms['dense']:.2f} ms/token, lowered "
          f"{ms['lowered']:.2f} ms/token, {row['speedup']:.2f}x" + (" (interpreter/CPU: not a speed)" if tiny else "")
          + f"; gmc op calls in a lowered step: {op_calls}"
          + (" (uncompiled)" if tiny else " (must be 0: the Triton kernels belong in the package)"))
    return [row]


class _ByteTokenizer:
    """Bytes -> ids (BOS 1): enough for calibration blocks of a model with random weights."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text, add_special_tokens=True, **_):
        return {"input_ids": ([1] if add_special_tokens else []) + [3 + b for b in text.encode("utf-8")]}


def check_learning(args, device: str) -> list[dict]:
    """Mask-learning steps on ``device``: GroupMask 1x64 at 50% on a SmolLM2-135M-shaped Llama with
    random weights (the step's cost does not depend on the weights' values), 256-token blocks,
    ``--precision auto`` (bf16 on CUDA). Each configuration is one short ``prune`` run: the steady
    step time is taken over its second half (``train_log.jsonl``'s throughput), the first step's
    time includes the compile of a compiled step. A row passes when the loss stayed finite and the
    export met the 50% budget. ``--tiny``: a tiny Llama, a few eager steps (the code path only)."""
    import json
    import tempfile
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from gmc.inputs.model import LoadedModel
    from gmc.masks.learn import LearnConfig
    from gmc.masks.prune import PruneConfig, prune

    if args.tiny:
        shape = dict(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=320)
        configs, seq_len = [("off", 1, 6)], 32
    else:  # SmolLM2-135M
        shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
        configs, seq_len = [("off", 1, 60), ("off", 4, 60), ("on", 1, 80)], 256
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=2048)).to(device).eval()
    rows = []
    for compile_step, batch, steps in configs:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory(prefix="gmc-gpu-check-") as scratch:
            learn = LearnConfig(steps=steps, batch_size=batch, compile_step=compile_step, progress=False,
                                checkpoint_every=10**9)
            config = PruneConfig(model="random", output=f"{scratch}/out", method="groupmask", group="1x64",
                                 sparsity=0.5, calib="bundled", nsamples=16, seq_len=seq_len, seed=args.seed,
                                 device=device, dtype="float32", learn=learn)
            started = time.perf_counter()
            artifact = prune(config, LoadedModel(model, _ByteTokenizer(), "random"))
            wall = time.perf_counter() - started
            log = [json.loads(line) for line in open(f"{scratch}/out/train_log.jsonl")]
        tokens = batch * seq_len
        until = lambda k: tokens * k / log[k - 1]["tok_per_s"]  # seconds from the first step's start to step k's end
        half = steps // 2
        steady = (until(steps) - until(half)) / (steps - half)
        training = artifact.manifest["training"]
        row = {"section": "learn", "model": "tiny llama" if args.tiny else "SmolLM2-135M shape, random weights",
               "precision": training["precision"], "compiled": training["compiled"], "batch": batch,
               "seq_len": seq_len, "steps": steps, "first_step_s": until(1), "step_ms": 1e3 * steady,
               "tokens_per_s": tokens / steady, "wall_s": wall,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
               "sparsity": artifact.manifest["global_sparsity"],
               "passed": all(math.isfinite(r["loss"]) for r in log) and abs(artifact.manifest["global_sparsity"] - 0.5) <= 0.01}
        print(f"{'PASS' if row['passed'] else 'FAIL'} learn {row['precision']} {'compiled' if row['compiled'] else 'eager'} "
              f"batch {batch} x {seq_len}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tok/s, first step "
              f"{row['first_step_s']:.1f} s, sparsity {row['sparsity']:.4f}"
              + (f", peak {row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else ""))
        rows.append(row)
    return rows


def _op_calls(step, *args) -> int:
    """Dispatcher calls of gmc's ops in one ``step``: none for a compiled CUDA package, which holds the
    ops' Triton kernels (``gmc.kernels.inline_on_cuda``); an uncompiled program calls one per product."""
    from torch.profiler import profile

    with torch.no_grad(), profile() as prof:
        step(*args)
    return sum(event.name.startswith("gmc::") for event in prof.events())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _device(interpret: bool) -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if interpret else None


def _section(name: str, run) -> list[dict]:
    """A section's rows; a section that raises is one failed row naming the error, and the
    sections after it still run (a GPU lease is too short to lose the rest to one error)."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001  (any failure is a finding to record)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        print(f"FAIL {name}: {type(error).__name__}: {first}")
        return [{"section": name, "passed": False, "error": f"{type(error).__name__}: {first}"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes and token counts (for TRITON_INTERPRET=1 on CPU)")
    parser.add_argument("--dtypes", help="comma-separated, e.g. float16,bfloat16 (default: all three for "
                                         "correctness, float16,bfloat16 for speed)")
    parser.add_argument("--tokens", help="comma-separated token counts for both sections (default 1,16,256,2048; "
                                         "--tiny: 1,5,33 and 1,33)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, any of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--json", metavar="PATH", help="write every row of every section here")
    args = parser.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = _device(interpret)
    if device is None:
        print(NO_DEVICE, file=sys.stderr)
        sys.exit(2)
    try:
        plan = Plan.from_args(args)
    except ValueError as error:
        parser.error(str(error))
    sections = args.sections.split(",")
    if unknown := [s for s in sections if s not in SECTIONS]:
        parser.error(f"bad --sections {','.join(unknown)}: expected any of {', '.join(SECTIONS)}")
    import triton

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    mode = "; TRITON_INTERPRET=1 (interpreter)" if interpret else ""
    print(f"device: {where}{mode}; torch {torch.__version__}, triton {triton.__version__}")
    runs = {"correctness": ("1. correctness (op vs F.linear(x, packed.unpack(), bias) in float64)",
                            lambda: check_correctness(plan, device, args.seed)),
            "speed": ("2. speed (op vs dense F.linear)", lambda: check_speed(plan, device, args.seed, interpret)),
            "decode": ("3. end-to-end compiled decode", lambda: check_decode(args, device, interpret)),
            "learn": ("4. mask-learning steps", lambda: check_learning(args, device))}
    rows = {name: [] for name in SECTIONS}
    for name, (title, run) in runs.items():
        if name in sections:
            print(f"\n## {title}")
            rows[name] = _section(name, run)
    checks = [row for section in rows.values() for row in section if "passed" in row]  # speed rows only on an error
    failed = sum(not row["passed"] for row in checks)
    print(f"\ncorrectness, decode and learning checks: {len(checks) - failed}/{len(checks)} passed")
    if args.json:
        report = {"device": where, "host": host(), "interpreter": interpret, "torch": torch.__version__,
                  "triton": triton.__version__, "seed": args.seed, "plan": asdict(plan), **rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
