"""gmc's CUDA path in one command: correctness, the op against cuBLAS, end-to-end decode, on one GPU.

    python bench/gpu_check.py --json gpu_check.json        # on a CUDA GPU: every default section (~6 min, H100)
    python bench/gpu_check.py --sections decode,e2e        # some sections
    TRITON_INTERPRET=1 python bench/gpu_check.py --tiny    # on CPU: the script's code paths on tiny shapes
    python bench/gpu_check.py --records gpu_check.json     # anywhere: bench/results/gpu.json from a run's report

Sections, in this order (``--sections``; one that raises is a failed row and the rest still run;
``--json`` is rewritten after each, so a run cut short keeps what it measured; ``--budget-s``
skips a section that would start too late to finish):

- env: the GPU, a device-to-device copy's GB/s (bytes read + written: the roofline a decode
  kernel is held to) and a bf16 GEMM's TFLOP/s, both in this run;
- correctness: the op on the tiled layout (``torch.ops.gmc.group_sparse_linear``, what a lowered
  model calls) against ``F.linear`` in float64 of the layer's own dense weight, over 1x256, 1x64,
  32x32, ragged ``d_in``, ragged 32x32 (each with an empty output group and an empty input block)
  and fully pruned layers; fp32, fp16, bf16; int8 and int4 values; 1 to 2,048 tokens. A case passes
  when ``|out - ref| <= atol + rtol |ref|`` everywhere; the exit code is 1 when one fails;
- decode: the op against cuBLAS ``F.linear`` at 1, 4 and 16 tokens on LLaMA-2-7B's shapes, 1x256
  and 1x64 at 50%, bf16 (and fp16 at one token); int8 and int4 1x256 against cuBLAS bf16: ms, the
  GB/s of the bytes each side reads and writes, and the lowered op's share of the copy bandwidth;
- prefill: 2,048 tokens, 1x256 and 32x32 at 50%, bf16: the op (through the layer's dense weight,
  ``dense_prefill``) and its tiled kernel's default launch; the paper's shape (11008x4096, 65,536
  tokens, 64x64 at 90%, fp32 inputs with TF32 products on both sides);
- e2e: a LLaMA-2-7B-shaped Llama with random bf16 weights and random 1x256 masks at 50%: decode
  tokens/s (128 tokens after a 16-token prompt, each step one CUDA graph replay,
  ``gmc.runtime.cuda_graph``) and a 512-token prefill (eager), dense vs lowered bf16 vs lowered
  int4; and the graphed decode's greedy tokens and teacher-forced logits against the eager model's;
- sweep: block sizes of the decode (1, 4 and 16 tokens: CUDA-core and tensor-core products, row
  slices, pipeline depth, split programs; 1x64, int8 and int4 at one token) and prefill (2,048)
  launches: the fastest that matches cuBLAS's output against the default ``choose_config`` picks
  (``--sweep decode`` times the decode launches alone);
- aoti: AOTInductor packages of a tiny Llama's decode programs (lowered; dense; dense with its
  constants inside the library; dense on the CPU), built, then loaded and run in a child process that
  names each stage: a crash is a row with its signal, its stage and the child's traceback, and the
  first crash is loaded again in a process that imports torch alone, with a native backtrace
  (``segv_backtrace.c``) and the toolchain that built the package;
- learn (not in the default list): mask-learning steps, GroupMask 1x64 on a SmolLM2-135M shape.

Timings (``bench/cuda_timing.py``): each call is captured in a CUDA graph over enough copies of
its weights to read past L2, and replays alternate with the baseline's; medians.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from cuda_timing import copies_for, copy_gbps, gemm_tflops, graphed_ms
from host import host
from shapes import LLAMA2_7B, Shape

from gmc.groups import GroupSpec
from gmc.kernels.packed import PackedLinear, integer_product, pack
from gmc.kernels.quantize import quantize
from gmc.kernels.tiled import TiledInputs, tile

NO_DEVICE = "needs a CUDA GPU or TRITON_INTERPRET=1"
SECTIONS = ("env", "correctness", "decode", "prefill", "e2e", "sweep", "aoti", "learn")
DEFAULT_SECTIONS = SECTIONS[:-1]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (atol, rtol) against the float64 reference; weights ~ N(0, 1 / d_in), so outputs are O(1). fp16/bf16
# accumulate in fp32 and round once (half an ulp: 4.9e-4 relative for fp16, 3.9e-3 for bf16).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
SECTION_SECONDS = {"env": 10, "correctness": 60, "decode": 60, "prefill": 40, "e2e": 120, "sweep": 120, "aoti": 260,
                   "learn": 240}  # what a section may take on an H100, for --budget-s


@dataclass(frozen=True)
class Case:
    group: str
    shape: Shape
    sparsity: float  # fraction of groups pruned at random (plus an empty output group and input block)
    how: str = "none"  # values: float, int8 or int4


Q, UP, DOWN = LLAMA2_7B
CASES = (
    Case("1x256", Q, 0.5), Case("1x64", Q, 0.5), Case("32x32", Q, 0.5), Case("1x256", DOWN, 0.5),
    Case("1x256", Shape("ragged d_in 1536x576", 1536, 576), 0.5), Case("32x32", Shape("ragged 100x70", 100, 70), 0.5),
    Case("1x256", Shape("all pruned 512x1024", 512, 1024), 1.0),
    Case("1x256", Q, 0.5, "int8"), Case("1x256", Q, 0.5, "int4"),
    Case("1x64", Shape("ragged d_in 1536x576", 1536, 576), 0.5, "int4"),
)
TINY = Shape("tiny 96x576", 96, 576)
TINY_CASES = (
    Case("1x256", TINY, 0.5), Case("1x64", Shape("tiny 128x320", 128, 320), 0.5),
    Case("32x32", Shape("ragged 100x70", 100, 70), 0.5), Case("1x256", Shape("all pruned 64x512", 64, 512), 1.0),
    Case("1x64", Shape("tiny 128x320", 128, 320), 0.5, "int4"),
)


@dataclass(frozen=True)
class Plan:
    """What one run measures; ``--tiny`` and the command-line overrides build it."""

    cases: tuple[Case, ...]
    check_tokens: tuple[int, ...]
    check_dtypes: tuple[str, ...]
    speed_shapes: tuple[Shape, ...]
    decode_tokens: tuple[int, ...]
    prefill_tokens: int
    paper_tokens: int  # tokens of the paper's 64x64 TF32 comparison (0: skip)
    llama: dict  # the end-to-end model's shape
    e2e_prompt: int = 16
    e2e_new_tokens: int = 128
    e2e_prefill: int = 512

    def __post_init__(self):
        unknown = set(self.check_dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"unknown dtypes {sorted(unknown)}; choose from {sorted(DTYPES)}")
        if min(self.check_tokens + self.decode_tokens) < 1:
            raise ValueError("token counts must be >= 1")

    @classmethod
    def from_args(cls, args) -> Plan:
        dtypes = tuple(args.dtypes.split(",")) if args.dtypes else None
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
        if args.tiny:
            return cls(TINY_CASES, tokens or (1, 5, 33), dtypes or ("float32", "float16", "bfloat16"), (TINY,),
                       (1, 5), 512, 0, dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                           num_attention_heads=4, vocab_size=256),
                       e2e_prompt=4, e2e_new_tokens=6, e2e_prefill=8)
        return cls(CASES, tokens or (1, 16, 256, 2048), dtypes or ("float32", "float16", "bfloat16"), LLAMA2_7B,
                   (1, 4, 16), 2048, 65536, dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                                 num_attention_heads=32, vocab_size=32000))


def _random_layer(case: Case, gen: torch.Generator, with_empty: bool) -> PackedLinear:
    """A random layer (CPU) with weights ``~ N(0, 1 / d_in)``, a bias, and its values as ``case.how``."""
    spec = GroupSpec(*map(int, case.group.split("x")))
    shape = case.shape
    weight = torch.randn(shape.d_out, shape.d_in, generator=gen) * shape.d_in ** -0.5  # [d_out, d_in]
    keep = torch.rand(spec.grid((shape.d_out, shape.d_in)), generator=gen) >= case.sparsity  # [G_out, G_in]
    if with_empty:
        keep[0] = False  # output rows with no kept group
        if keep.shape[1] > 1:
            keep[:, 1] = False  # an input block with no kept row
    return quantize(pack(weight, keep, spec, torch.randn(shape.d_out, generator=gen)), case.how)


@dataclass
class OnDevice:
    """A layer as the CUDA kernel reads it, with its float bias."""

    tiled: TiledInputs
    bias: torch.Tensor | None
    d_out: int
    g_in: int

    @classmethod
    def of(cls, layer: PackedLinear, device: str, dtype: torch.dtype) -> OnDevice:
        moved = layer.to(device=device, dtype=dtype if layer.quantized == "none" else None)
        tiled = tile(moved.values, moved.row_idx, moved.row_ptr, moved.scales, *layer.shape, layer.spec.g_in)
        bias = None if moved.bias is None else moved.bias.to(dtype)
        return cls(tiled, bias, layer.shape[0], layer.spec.g_in)

    def copy(self) -> OnDevice:
        t = self.tiled
        return OnDevice(TiledInputs(t.values.clone(), t.entries.clone(), t.tile_ptr.clone(),
                                    None if t.scales is None else t.scales.clone()), self.bias, self.d_out, self.g_in)

    @property
    def nbytes(self) -> int:
        t = self.tiled
        return _nbytes(t.values, t.entries, t.tile_ptr, *(() if t.scales is None else (t.scales,)))


def _op(device: str):
    """The call under test: ``call(x, layer, config=None, bias=True)``. On CUDA the registered op (what a
    lowered model calls; a ``config`` goes to the Triton wrapper), on CPU the wrapper under the interpreter."""
    from gmc.kernels.triton_group_sparse import triton_group_sparse_linear

    if device == "cuda":
        import gmc.kernels.group_sparse_linear  # noqa: F401  (defines torch.ops.gmc.group_sparse_linear)
    registered = torch.ops.gmc.group_sparse_linear if device == "cuda" else None

    def call(x, layer: OnDevice, config=None, bias: bool = True):
        t, b = layer.tiled, layer.bias if bias else None
        if registered is not None and config is None:
            return registered(x, t.values, t.entries, t.tile_ptr, b, layer.d_out, layer.g_in, t.scales)
        return triton_group_sparse_linear(x, t.values, t.entries, t.tile_ptr, b, layer.d_out, layer.g_in, t.scales,
                                          config=config)
    return call


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _kept(layer: PackedLinear) -> float:
    scale = 2 if layer.quantized == "int4" else 1
    return layer.values.numel() * scale / (layer.shape[0] * layer.shape[1])


# ------------------------------------------------------------------------------ env, correctness


def check_env(plan: Plan, device: str, args) -> list[dict]:
    if device != "cuda":
        return [{"section": "env", "gpu": "CPU (interpreter)", "copy_gbps": None, "gemm_tflops": None}]
    props = torch.cuda.get_device_properties(0)
    row = {"section": "env", "gpu": props.name, "sms": props.multi_processor_count,
           "l2_mib": getattr(props, "L2_cache_size", 0) / 2**20, "memory_gib": props.total_memory / 2**30,
           "copy_gbps": copy_gbps(torch.device("cuda")), "gemm_tflops": gemm_tflops(torch.device("cuda"))}
    print(f"{row['gpu']}: {row['sms']} SMs, L2 {row['l2_mib']:.0f} MiB; device copy {row['copy_gbps']:,.0f} GB/s "
          f"(read + written); bf16 GEMM 8192^3 {row['gemm_tflops']:.0f} TFLOP/s", flush=True)
    return [row]


def check_correctness(plan: Plan, device: str, seed: int) -> list[dict]:
    """One row per (case, dtype, tokens): PASS/FAIL with max abs and max relative error."""
    op = _op(device)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for case in plan.cases:
        layer = _random_layer(case, gen, with_empty=True)
        dtypes = plan.check_dtypes if case.how == "none" else tuple(d for d in plan.check_dtypes if d != "float32")
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            atol, rtol = TOLERANCES[dtype]
            on = OnDevice.of(layer, device, dtype)
            # [d_out, d_in] in float64 on the device: the weights the kernel reads (rounded, or dequantized)
            weight = (layer if case.how != "none" else layer.to(dtype=dtype)).unpack().to(device, torch.float64)
            for tokens in plan.check_tokens:
                x = torch.randn(tokens, case.shape.d_in, generator=gen).to(device=device, dtype=dtype)  # [T, d_in]
                out = op(x, on)  # [T, d_out]
                ref = F.linear(x.double(), weight, on.bias.double())  # [T, d_out]
                err = (out.double() - ref).abs()
                ok = (out.dtype == dtype and out.shape == ref.shape and bool(torch.isfinite(out).all())
                      and bool((err <= atol + rtol * ref.abs()).all()))
                row = {"section": "correctness", "group": case.group, "shape": case.shape.name, "how": case.how,
                       "d_out": case.shape.d_out, "d_in": case.shape.d_in, "sparsity": case.sparsity,
                       "kept": _kept(layer), "dtype": dtype_name, "tokens": tokens, "max_abs_err": err.max().item(),
                       "max_rel_err": (err.max() / ref.abs().max().clamp_min(1e-30)).item(), "atol": atol,
                       "rtol": rtol, "passed": ok}
                rows.append(row)
                print(f"{'PASS' if ok else 'FAIL'}  {case.group:>5} {case.how:<4} {case.shape.name:<22} "
                      f"{dtype_name:<8} tokens={tokens:<5} max abs {row['max_abs_err']:.2e}  "
                      f"max rel {row['max_rel_err']:.2e}",
                      flush=True)
    return rows


# ------------------------------------------------------------------------------ op speed


def _compare(device: str, shape: Shape, dense_weight: torch.Tensor, lowered: OnDevice, x: torch.Tensor,
             config=None) -> dict:
    """cuBLAS ``F.linear`` vs the op on ``x``, each over its own copies of the weights."""
    op = _op(device)
    dev = torch.device(device)
    out_bytes = x.shape[0] * shape.d_out * x.element_size()
    dense_bytes = _nbytes(dense_weight, x) + out_bytes
    lowered_bytes = lowered.nbytes + _nbytes(x) + out_bytes
    bias = lowered.bias  # both sides add the layer's bias (cuBLAS in its epilogue)
    dense_copies = [dense_weight] + [dense_weight.clone() for _ in range(copies_for(dense_bytes, dev) - 1)]
    lowered_copies = [lowered] + [lowered.copy() for _ in range(copies_for(lowered_bytes, dev) - 1)]
    from gmc.kernels.triton_group_sparse import default_config, dense_prefill, gpu_of

    t = lowered.tiled
    # the op by itself: through the dense weight (a prefill dense_prefill picks), else its default launch
    through_dense = config is None and dense_prefill(x.shape[0], t.entries, t.tile_ptr, shape.d_in, lowered.g_in)
    if config is None and not through_dense:
        config = default_config(x, t.values, t.entries, t.scales, shape.d_out, lowered.g_in, gpu_of(dev))
    ms = graphed_ms({"dense": [partial(F.linear, x, w, bias) for w in dense_copies],
                     "lowered": [partial(op, x, layer, config) for layer in lowered_copies]})
    return {"config": DENSE_PATH if through_dense else _short(config), "dense_ms": ms["dense"],
            "lowered_ms": ms["lowered"],
            "speedup": ms["dense"] / ms["lowered"],
            "dense_bytes": dense_bytes, "lowered_bytes": lowered_bytes,
            "dense_gbps": dense_bytes / ms["dense"] / 1e6, "lowered_gbps": lowered_bytes / ms["lowered"] / 1e6,
            "copies": [len(dense_copies), len(lowered_copies)]}


def _speed_row(section: str, case: Case, dtype_name: str, tokens: int, measured: dict, copy_bw: float | None,
               timer: str) -> dict:
    row = {"section": section, "shape": case.shape.name, "d_out": case.shape.d_out, "d_in": case.shape.d_in,
           "group": case.group, "sparsity": case.sparsity, "how": case.how, "dtype": dtype_name, "tokens": tokens,
           "timer": timer, **measured,
           "copy_share": measured["lowered_gbps"] / copy_bw if copy_bw else None}
    share = f", {row['copy_share']:.0%} of copy" if copy_bw else ""
    print(f"| {section} | {case.shape.name} | {case.group} {case.how} | {dtype_name} | {tokens} | "
          f"{row['dense_ms'] * 1e3:.1f} | {row['lowered_ms'] * 1e3:.1f} | {row['speedup']:.2f}x | "
          f"{row['dense_gbps']:,.0f} | {row['lowered_gbps']:,.0f}{share} |", flush=True)
    return row


def _timer(device: str) -> str:
    return "CUDA graph replays, L2-spanning copies" if device == "cuda" else "interpreter wall clock (not a speed)"


def check_decode(plan: Plan, device: str, seed: int, copy_bw: float | None) -> list[dict]:
    """The op vs cuBLAS at decode token counts; int8 and int4 against cuBLAS bf16."""
    gen = torch.Generator().manual_seed(seed)
    print("| section | layer | group | dtype | tokens | cuBLAS us | lowered us | speedup | cuBLAS GB/s "
          "| lowered GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in plan.speed_shapes:
        for group, how, dtypes, tokens_list in (
                ("1x256", "none", ("bfloat16", "float16"), plan.decode_tokens), ("1x64", "none", ("bfloat16",),
                                                                                 plan.decode_tokens),
                ("1x256", "int8", ("bfloat16",), plan.decode_tokens[:1] + plan.decode_tokens[-1:]),
                ("1x256", "int4", ("bfloat16",), plan.decode_tokens[:1] + plan.decode_tokens[-1:])):
            case = Case(group, shape, 0.5, how)
            layer = _random_layer(case, gen, with_empty=False)
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                dense = layer.unpack().to(device=device, dtype=dtype)  # [d_out, d_in]: cuBLAS reads every weight
                lowered = OnDevice.of(layer, device, dtype)
                for tokens in (tokens_list if dtype_name == "bfloat16" else tokens_list[:1]):
                    x = torch.randn(tokens, shape.d_in, generator=gen).to(device=device, dtype=dtype)
                    rows.append(_speed_row("decode", case, dtype_name, tokens,
                                           _compare(device, shape, dense, lowered, x), copy_bw, _timer(device)))
                del dense, lowered
    return rows


DENSE_PATH = "dense weight + cuBLAS"  # the config column of a prefill the op runs through the layer's dense weight


def check_prefill(plan: Plan, device: str, seed: int) -> list[dict]:
    """The op vs cuBLAS at prefill token counts, and the paper's 64x64-at-90% TF32 comparison. Where the op
    goes through the dense weight (``dense_prefill``), a second row times its tiled kernel's default launch."""
    from gmc.kernels.triton_group_sparse import default_config, dense_prefill, gpu_of

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for shape in plan.speed_shapes:
        for group in ("1x256", "32x32"):
            case = Case(group, shape, 0.5)
            layer = _random_layer(case, gen, with_empty=False)
            dense = layer.unpack().to(device=device, dtype=torch.bfloat16)
            lowered = OnDevice.of(layer, device, torch.bfloat16)
            x = torch.randn(plan.prefill_tokens, shape.d_in, generator=gen).to(device=device, dtype=torch.bfloat16)
            t = lowered.tiled
            configs = [None]  # the op by itself; beside it the tiled kernel, where the op takes the dense weight
            if dense_prefill(x.shape[0], t.entries, t.tile_ptr, shape.d_in, lowered.g_in):
                configs.append(default_config(x, t.values, t.entries, t.scales, shape.d_out, lowered.g_in,
                                              gpu_of(torch.device(device))))
            for config in configs:
                measured = _compare(device, shape, dense, lowered, x, config)
                measured["dense_tflops"] = 2 * x.shape[0] * shape.d_out * shape.d_in / measured["dense_ms"] / 1e9
                rows.append(_speed_row("prefill", case, "bfloat16", plan.prefill_tokens, measured, None,
                                       _timer(device)))
    if plan.paper_tokens:
        rows.append(_paper_shape(plan, device, gen))
    return rows


def _paper_shape(plan: Plan, device: str, gen: torch.Generator) -> dict:
    """The paper's CUTLASS comparison: M = 11008, K = 4096, N = 65,536 tokens, 64x64 groups at 90%, fp32
    inputs with TF32 products (cuBLAS with TF32 allowed, as the paper measured)."""
    case = Case("64x64", Shape("paper 11008x4096", 11008, 4096), 0.9)
    layer = _random_layer(case, gen, with_empty=False)
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        dense = layer.unpack().to(device)
        lowered = OnDevice.of(layer, device, torch.float32)
        x = torch.randn(plan.paper_tokens, 4096, device=device)
        measured = _compare(device, case.shape, dense, lowered, x)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    measured["dense_tflops"] = 2 * plan.paper_tokens * 11008 * 4096 / measured["dense_ms"] / 1e9
    return _speed_row("prefill", case, "float32 (TF32)", plan.paper_tokens, measured, None, _timer(device))


def _decode_configs(tokens: int, how: str, narrow: bool) -> list:
    """Decode launches around the defaults: CUDA-core products of one token row (``block_t`` 1) and
    tensor-core ones (16), row slices, warps, pipeline depth, programs splitting a tile's entries."""
    from gmc.kernels.triton_group_sparse import KernelConfig as K

    if narrow:  # 1x64: four blocks a step, or fewer
        return [K(1, 32, 256, 4, s, x) for s in (3, 4, 6) for x in (1, 2)] + [K(1, 32, 128, 4, 4, 2),
                                                                            K(16, 32, 64, 4, 5, 3)]
    if how == "int8":  # and one token by integer dot products (dp4a) in 64- and 128-row slices
        return [K(16, r, 256, 4, 5, x) for r in (32, 64) for x in (2, 4)] + [
            K(1, 32, 256, 4, s, 2) for s in (3, 4)] + [  # 128 columns of int8 spill under triton 3.9
            K(1, 64, 256, 2, s, x, dot4=True) for s in (3, 4) for x in (2, 4)] + [K(1, 128, 256, 4, 4, 4, dot4=True)]
    if how == "int4":  # and each one-token launch with its codes made floats through the mantissa, and by
        # integer dot products (dp4a) in 64- and 128-row slices
        one = [K(1, 32, 256, 4, s, x) for s in (3, 4) for x in (2, 3, 4)] + [K(1, 32, 256, 8, 4, 4)]
        dot4 = [K(1, 64, 256, 2, s, x, dot4=True) for s in (3, 4) for x in (2, 4, 8)] + [
            K(1, 128, 256, 4, 4, x, dot4=True) for x in (4, 8)] + [K(1, 32, 256, 4, 4, 4, dot4=True)]
        return one + [replace(c, mantissa=True) for c in one] + dot4 + [K(16, 32, 256, 4, 5, 3)]
    if tokens >= 16:
        return [K(16, 64, 256, 4, 5, x) for x in (1, 2, 4)] + [K(16, 32, 256, 4, 5, x) for x in (2, 4)] + [
            K(16, 64, 256, 4, 4, x) for x in (2, 4)] + [K(16, 64, 256, 4, 3, 4)]
    if tokens > 1:
        return [K(16, 32, 256, 4, 5, x) for x in (1, 2, 4)] + [K(16, 64, 256, 4, 5, x) for x in (2, 4)] + [
            K(16, 32, 256, 4, s, 4) for s in (3, 4)] + [K(4, 32, 64, 4, 8, 1)]
    return [K(1, 32, 256, 4, s, x) for s in (2, 3, 4) for x in (1, 2, 4)] + [
        K(1, 16, 256, w, 4, x) for w in (2, 4) for x in (2, 4)] + [K(1, 64, 256, 8, 3, x) for x in (1, 2)] + [
        K(16, 32, 256, 4, 5, 2)]


PREFILL_CONFIGS = ((128, 64, 8, 3), (128, 64, 8, 5), (128, 32, 8, 4), (64, 64, 4, 3), (256, 64, 8, 3),
                   (128, 128, 8, 3))
PREFILL_2D_CONFIGS = ((128, 32, 4, 4), (256, 32, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (256, 64, 8, 3))


def check_sweep(plan: Plan, device: str, seed: int, kinds: tuple[str, ...] = ("decode", "prefill")) -> list[dict]:
    """Block sizes around ``default_config``'s, bf16. ``decode`` (``_decode_configs``): 1, 4 and 16 tokens on
    the 1x256 shapes; 1x64, int8 and int4 1x256 at one token on the first shape. ``prefill``: 2,048 tokens
    on the 1x256 shapes, 32x32 on the first. Every launch's output is checked against cuBLAS's; one off by
    more than bf16 rounding is a failed row and never the fastest."""
    from gmc.kernels.triton_group_sparse import KernelConfig

    gen = torch.Generator().manual_seed(seed)
    prefill = [KernelConfig(t, 128, k, w, s) for t, k, w, s in PREFILL_CONFIGS]
    prefill_2d = [KernelConfig(t, 64, k, w, s) for t, k, w, s in PREFILL_2D_CONFIGS]
    jobs = []
    for index, shape in enumerate(plan.speed_shapes):
        if "decode" in kinds:
            jobs += [(Case("1x256", shape, 0.5), tokens, _decode_configs(tokens, "none", False))
                     for tokens in plan.decode_tokens]
            if index == 0:
                jobs += [(Case("1x64", shape, 0.5), plan.decode_tokens[0], _decode_configs(1, "none", True)),
                         (Case("1x256", shape, 0.5, "int8"), plan.decode_tokens[0], _decode_configs(1, "int8", False)),
                         (Case("1x256", shape, 0.5, "int4"), plan.decode_tokens[0], _decode_configs(1, "int4", False))]
        if "prefill" in kinds:
            jobs.append((Case("1x256", shape, 0.5), plan.prefill_tokens, prefill))
            if index == 0:
                jobs.append((Case("32x32", shape, 0.5), plan.prefill_tokens, prefill_2d))
    if device != "cuda":  # the interpreter: the code path, a few launches (an integer-dot-product one among them)
        jobs = [(case, tokens, configs[:2] + [c for c in configs if c.dot4][:1]) for case, tokens, configs in jobs
                if tokens <= plan.decode_tokens[-1]]
    rows, layers = [], {}
    for case, tokens, configs in jobs:
        if case not in layers:
            layer = _random_layer(case, gen, with_empty=False)
            layers.clear()  # one layer's copies on the device at a time
            layers[case] = (layer.unpack().to(device=device, dtype=torch.bfloat16),
                            OnDevice.of(layer, device, torch.bfloat16), layer)
        dense, lowered, layer = layers[case]
        rows.append(_sweep_row(device, case, tokens, configs, dense, lowered, gen, layer))
    return rows


def _sweep_row(device: str, case: Case, tokens: int, configs, dense, lowered: OnDevice, gen,
               layer: PackedLinear) -> dict:
    """``configs`` timed on ``lowered`` (``layer`` on the device), each output checked against cuBLAS's, or,
    for an integer-dot-product launch (``dot4``, whose x is quantized to int8), against what those
    products compute (``integer_product``, the CPU's int4 products' reference)."""
    from gmc.kernels.triton_group_sparse import default_config, gpu_of

    shape = case.shape
    x = torch.randn(tokens, shape.d_in, generator=gen).to(device=device, dtype=torch.bfloat16)
    t = lowered.tiled
    default = default_config(x, t.values, t.entries, t.scales, shape.d_out, lowered.g_in, gpu_of(torch.device(device)))
    ref = F.linear(x.float(), dense.float(), lowered.bias.float())  # [T, d_out]
    integer = None
    if any(config.dot4 for config in configs):
        integer = (integer_product(replace(layer, bias=None), x.float().cpu()).float().to(device)
                   + lowered.bias.float())
    atol, rtol = TOLERANCES[torch.bfloat16]
    op = _op(device)
    found, errors = {}, {}
    for config in dict.fromkeys([default, *configs]):
        try:
            out = op(x, lowered, config).float()
            expected = integer if config.dot4 else ref
            errors[config] = ((out - expected).abs() / (atol + rtol * expected.abs())).max().item()  # <= 1 passes
            found[config] = _compare(device, shape, dense, lowered, x, config)
        except Exception as error:  # noqa: BLE001  (a config that does not compile is a finding)
            print(f"sweep {shape.name} T={tokens} {_short(config)}: {type(error).__name__}: {str(error)[:120]}")
    passing = [c for c in found if errors[c] <= 1]
    best = min(passing or found, key=lambda c: found[c]["lowered_ms"])
    row = {"section": "sweep", "shape": shape.name, "group": case.group, "how": case.how, "tokens": tokens,
           "default": asdict(default), "default_ms": found[default]["lowered_ms"],
           "default_speedup": found[default]["speedup"], "best": asdict(best), "best_ms": found[best]["lowered_ms"],
           "best_speedup": found[best]["speedup"], "dense_ms": found[default]["dense_ms"],
           "passed": len(passing) == len(found),
           "all": [{**asdict(c), "ms": m["lowered_ms"], "speedup": m["speedup"], "error_vs_tolerance": errors[c]}
                   for c, m in found.items()]}
    print(f"sweep {shape.name} {case.group} {case.how} T={tokens}: default {_short(default)} "
          f"{row['default_ms'] * 1e3:.1f} us ({row['default_speedup']:.2f}x); best {_short(best)} "
          f"{row['best_ms'] * 1e3:.1f} us ({row['best_speedup']:.2f}x)"
          + ("" if row["passed"] else f"; {len(found) - len(passing)} launches off the reference"), flush=True)
    for config, measured in sorted(found.items(), key=lambda item: item[1]["lowered_ms"])[:8]:
        print(f"    {_short(config):<28} {measured['lowered_ms'] * 1e3:7.1f} us  {measured['speedup']:.2f}x  "
              f"error/tolerance {errors[config]:.2f}", flush=True)
    return row


def _short(config) -> str:
    return (f"T{config.block_t} R{config.sub_r} K{config.block_k} w{config.num_warps} s{config.num_stages} "
            f"x{config.split}" + (" mantissa" if config.mantissa else "") + (" dot4" if config.dot4 else ""))


# ------------------------------------------------------------------------------ end to end


def _llama(plan: Plan, device: str, dtype: torch.dtype, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**plan.llama, max_position_embeddings=4096, tie_word_embeddings=False)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(saved)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def check_e2e(plan: Plan, device: str, seed: int) -> list[dict]:
    """Decode and prefill of a LLaMA-2-7B-shaped model: dense, lowered bf16, lowered int4, and lowered int4
    with its one-token launches by integer dot products (``INT4_ONE_TOKEN_DOT4``) (same path:
    ``gmc.runtime.generate`` over a ``GraphedStep`` decode); the graphed decode against eager (``_greedy_match``)."""
    from gmc.graph.pipeline import pack_targets
    from gmc.graph.targets import eager_targets
    from gmc.groups import parse_pattern
    from gmc.kernels import triton_group_sparse
    from gmc.kernels.linear import GroupSparseLinear, swap_group_sparse_linears
    from gmc.kernels.quantize import quantize_int4

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _llama(plan, device, dtype, seed)
    pattern = parse_pattern("1x256" if device == "cuda" else "1x16")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, plan.llama["vocab_size"], (1, plan.e2e_prompt), generator=gen)
    long_prompt = torch.randint(0, plan.llama["vocab_size"], (1, plan.e2e_prefill), generator=gen)
    rows = []
    masks = {t.name: torch.rand(pattern.grid(t.shape), generator=gen) >= 0.5 for t in eager_targets(model)}
    for label in ("dense", "lowered bf16", "lowered int4", "lowered int4, dot4"):
        triton_group_sparse.INT4_ONE_TOKEN_DOT4 = label.endswith("dot4")  # the launch is chosen at each call
        if label == "lowered bf16":
            swap_group_sparse_linears(model, pack_targets(model, masks, pattern))
        elif label == "lowered int4":
            layers = {name: module for name, module in model.named_modules() if isinstance(module, GroupSparseLinear)}
            for name, module in layers.items():  # one at a time: the bf16 and int4 copies of a layer, briefly
                swap_group_sparse_linears(model, {name: quantize_int4(module.packed())})
        torch.cuda.empty_cache() if device == "cuda" else None
        try:
            measured = _decode_and_prefill(model, plan, device, dtype, prompt, long_prompt)
        finally:
            triton_group_sparse.INT4_ONE_TOKEN_DOT4 = False
        row = {"section": "e2e", "model": _model_name(plan), "weights": label, "device": device, **measured,
               "weight_gib": _weight_bytes(model) / 2**30}
        if label == "lowered bf16":
            row.update(_greedy_match(model, plan, device, dtype, prompt))
        rows.append(row)
        print(f"e2e {label}: decode {row['decode_ms']:.2f} ms/token in the graph ({1e3 / row['decode_ms']:.1f} tok/s; "
              f"{row['generate_tok_s']:.1f} tok/s through gmc's loop); prefill {plan.e2e_prefill} tokens "
              f"{row['prefill_ms']:.1f} ms; weights {row['weight_gib']:.2f} GiB"
              + (f"; greedy tokens equal to eager: {row['greedy_equal']}/{row['greedy_tokens']}, teacher-forced "
                 f"logits {row['logits_rel_error']:.1e} of eager's (<= {LOGITS_RTOL:g} passes)"
                 if "greedy_equal" in row else ""), flush=True)
    base = rows[0]
    for row in rows:
        row["decode_speedup"] = base["decode_ms"] / row["decode_ms"]
        row["prefill_speedup"] = base["prefill_ms"] / row["prefill_ms"]
        row["passed"] = row.get("logits_rel_error", 0.0) <= LOGITS_RTOL
    return rows


def _model_name(plan: Plan) -> str:
    shape = plan.llama
    return (f"Llama {shape['num_hidden_layers']} x {shape['hidden_size']} (d_ff {shape['intermediate_size']}, "
            f"vocab {shape['vocab_size']}), random weights")


def _weight_bytes(model) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return _nbytes(*tensors.values())


def _decode_and_prefill(model, plan: Plan, device: str, dtype, prompt, long_prompt) -> dict:
    from gmc.graph.decode import CachedLM, KVCache
    from gmc.runtime.generate import SampleConfig, generate

    cache = KVCache.empty(model.config, plan.e2e_prompt + plan.e2e_new_tokens + 1, dtype, device)
    decode = _graphed(model, cache) if device == "cuda" else CachedLM(model, static=True)
    generation = generate({"prefill": CachedLM(model), "decode": decode}, cache, prompt,
                          SampleConfig(max_new_tokens=plan.e2e_new_tokens))
    replay_ms = _replay_ms(decode) if device == "cuda" else statistics.median(generation.decode_s) * 1e3
    long_cache = KVCache.empty(model.config, plan.e2e_prefill + 1, dtype, device)
    step = CachedLM(model)
    times = []
    with torch.no_grad():
        for _ in range(3):
            start = time.perf_counter()
            step(long_prompt.to(device), torch.tensor(0, device=device), long_cache.keys, long_cache.values)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return {"decode_ms": replay_ms, "generate_tok_s": 1 / statistics.median(generation.decode_s),
            "prefill_ms": statistics.median(times[1:]), "prompt": plan.e2e_prompt, "new_tokens": plan.e2e_new_tokens,
            "prefill_tokens": plan.e2e_prefill}


def _graphed(model, cache):
    from gmc.runtime.cuda_graph import GraphedStep

    return GraphedStep(model, cache)


def _replay_ms(step, replays: int = 50) -> float:
    """GPU milliseconds of one graphed decode step, replayed back to back (the position does not
    change its work: attention reads every slot under a mask)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        step.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


LOGITS_RTOL = 2e-2  # teacher-forced logits of the graphed step against eager: a few bf16 roundings


def _greedy_match(model, plan: Plan, device: str, dtype, prompt, new_tokens: int = 24) -> dict:
    """The graphed decode against the eager one (``CachedLM``, filled slots only): their greedy tokens, and
    the logits each computes when both are fed the eager tokens (max |graphed - eager| over max |eager|,
    worst step). The logits decide: a random-weight model's top two logits can lie within a bf16 rounding,
    so greedy paths may part where the two compute the same function."""
    from gmc.graph.decode import CachedLM, KVCache
    from gmc.runtime.generate import SampleConfig, generate

    tokens, logits = {}, {}
    for label in ("eager", "graphed"):
        cache = KVCache.empty(model.config, plan.e2e_prompt + new_tokens + 1, dtype, device)
        decode = CachedLM(model) if label == "eager" else (
            _graphed(model, cache) if device == "cuda" else CachedLM(model, static=True))
        tokens[label] = generate({"prefill": CachedLM(model), "decode": decode}, cache, prompt,
                                 SampleConfig(max_new_tokens=new_tokens)).tokens
        with torch.no_grad():  # the same tokens in, step by step: the eager run's (a graph keeps its cache)
            CachedLM(model)(prompt.to(device), torch.tensor(0, device=device), cache.keys, cache.values)
            steps = []
            for i, token in enumerate(tokens["eager"][:-1]):
                out = decode(torch.tensor([[token]], device=device), torch.tensor(plan.e2e_prompt + i, device=device),
                             cache.keys, cache.values)
                steps.append(out.float().cpu().clone())
        logits[label] = steps
    equal = next((i for i, (a, b) in enumerate(zip(tokens["eager"], tokens["graphed"])) if a != b), new_tokens)
    error = max(((g - e).abs().max() / e.abs().max()).item() for e, g in zip(logits["eager"], logits["graphed"]))
    return {"greedy_tokens": new_tokens, "greedy_equal": equal, "logits_rel_error": error}


# ------------------------------------------------------------------------------ AOTInductor


_AOTI_BUILD = textwrap.dedent("""
    import json, sys, time, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import gmc.lower.compile as compiled
    from gmc.graph.decode import CachedLM, KVCache
    from gmc.graph.pipeline import lower, lower_decode
    from gmc.graph.targets import eager_targets
    from gmc.groups import parse_pattern
    out, variant = sys.argv[1], sys.argv[2]
    device, dtype = ("cpu", torch.float32) if variant.endswith("on the CPU") else ("cuda", torch.bfloat16)
    if variant.endswith("constants in the .so"):
        compiled.INDUCTOR_CONFIGS = {**compiled.INDUCTOR_CONFIGS, "aot_inductor.package_constants_in_so": True}
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    pattern = parse_pattern("1x64")
    gen = torch.Generator().manual_seed(0)
    masks = {t.name: torch.rand(pattern.grid(t.shape), generator=gen) >= 0.5 for t in eager_targets(model)}
    packed = {} if variant.startswith("dense") else lower(model, masks, pattern)[1]
    model = model.to(device, dtype)
    packed = {name: layer.to(device, dtype) for name, layer in packed.items()}
    started = time.perf_counter()
    compiled.compile_programs(lower_decode(model, packed, 64), out, 64)
    build_s = time.perf_counter() - started
    from gmc.kernels.linear import swap_group_sparse_linears
    swap_group_sparse_linears(model, packed)
    cache = KVCache.empty(config, 64, dtype, device)
    ids = torch.randint(0, 512, (1, 8), generator=gen).to(device)
    with torch.no_grad():
        step = CachedLM(model)
        step(ids, torch.tensor(0, device=device), cache.keys, cache.values)
        logits = step(ids[:, :1], torch.tensor(8, device=device), cache.keys, cache.values)
    torch.save({"ids": ids.cpu(), "logits": logits.float().cpu()}, out + "/reference.pt")
    print(json.dumps({"build_s": build_s}))
""")

# What gmc.formats.compiled.load_compiled does, which refuses CUDA packages: each stage says so first,
# so a crash names the stage it happened in.
_AOTI_LOAD = textwrap.dedent("""
    import json, sys, torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from gmc.formats.compiled import CONSTANTS_FILE, CompiledStep
    from gmc.graph.decode import KVCache
    out = sys.argv[1] + "/compiled"
    device, dtype = ("cpu", torch.float32) if sys.argv[2].endswith("on the CPU") else ("cuda", torch.bfloat16)
    if device == "cpu":  # a CPU package links gmc's runtime library: loaded with the kernel, as gmc's loader does
        from gmc.kernels.cpu_group_sparse import kernel
        kernel()
    constants = {name: t.to(device) for name, t in load_file(out + "/" + CONSTANTS_FILE).items()}
    steps = {}
    for name in ("prefill", "decode"):
        print(f"aoti_load_package {name}", flush=True)
        runner = torch._inductor.aoti_load_package(f"{out}/{name}.pt2")
        print(f"load_constants {name}", flush=True)
        wanted = runner.get_constant_fqns()
        runner.load_constants({k: constants[k] for k in wanted if k in constants}, check_full_update=True,
                              user_managed=True)
        steps[name] = CompiledStep(runner, out)
    reference = torch.load(sys.argv[1] + "/reference.pt")
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=512)
    cache = KVCache.empty(config, 64, dtype, device)
    ids = reference["ids"].to(device)
    print("run", flush=True)
    steps["prefill"](ids, torch.tensor(0, device=device), cache.keys, cache.values)
    logits = steps["decode"](ids[:, :1], torch.tensor(8, device=device), cache.keys, cache.values).float().cpu()
    error = ((logits - reference["logits"]).abs().max() / reference["logits"].abs().max()).item()
    print(json.dumps({"rel_error": error}))
""")
# The load alone, in a process that imports torch and nothing else (no transformers, gmc or safetensors):
# whether the crash needs anything beyond torch.
_AOTI_BARE = "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1]); print('loaded', flush=True)"
AOTI_VARIANTS = ("lowered", "dense", "dense with constants in the .so", "dense on the CPU")


def _toolchain(package: str) -> dict:
    """What built a package's wrapper library and what it holds of libstdc++: the C++ compiler's version,
    how many of libstdc++'s locale and codecvt functions the wrapper defines itself (a linked-in copy
    where any) and the libstdc++ it loads."""
    found = {}
    if compiler := shutil.which("c++"):
        found["cxx"] = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    with zipfile.ZipFile(package) as archive, tempfile.TemporaryDirectory() as scratch:
        wrappers = [name for name in archive.namelist() if name.endswith(".wrapper.so")]
        if not wrappers:
            return found
        wrapper = archive.extract(wrappers[0], scratch)
        if nm := shutil.which("nm"):
            symbols = subprocess.run([nm, "-DC", "--defined-only", wrapper], capture_output=True, text=True).stdout
            found["wrapper_libstdcxx_symbols"] = sum(("std::locale::" in line or "std::codecvt<" in line)
                                                     for line in symbols.splitlines())
        if ldd := shutil.which("ldd"):
            linked = subprocess.run([ldd, wrapper], capture_output=True, text=True).stdout
            found["wrapper_libstdcxx"] = next((line.strip() for line in linked.splitlines() if "libstdc++" in line),
                                              "(none)")
    return found


def _aoti_diagnose(out: str, env: dict, variant: str) -> dict:
    """After a crashed load: the bare load's exit code, the package's toolchain, and a native backtrace of
    the first loader that crashes (bare if it dies of a signal, else the full one) from ``segv_backtrace.c``
    preloaded, built with the compiler that built the package (gdb on a process that loads torch took
    longer than a lease can give)."""
    package = f"{out}/compiled/prefill.pt2"
    print("aoti: bare load", flush=True)
    bare = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _AOTI_BARE, package], env=env,
                          capture_output=True, text=True, timeout=180)
    found = {"bare_load_rc": bare.returncode, "bare_stderr": bare.stderr[-600:], **_toolchain(package)}
    crashed = bare.returncode < 0  # killed by a signal; a Python error (a CPU package's runtime library) is not
    program = [_AOTI_BARE, package] if crashed else [_AOTI_LOAD, out, variant]
    found["traced_program"] = "bare" if crashed else "full"
    library = f"{out}/segv_backtrace.so"
    compiler = shutil.which("cc") or shutil.which("c++")  # a package that built had one
    source = Path(__file__).with_name("segv_backtrace.c")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", library, str(source)], check=True, timeout=60)
    print(f"aoti: {found['traced_program']} load with a backtrace handler", flush=True)
    traced = subprocess.run([sys.executable, "-c", *program], env={**env, "LD_PRELOAD": library},
                            capture_output=True, text=True, timeout=180)
    marker = traced.stderr.find("native backtrace")
    found["backtrace"] = traced.stderr[marker:marker + 5000] if marker >= 0 else ""
    return found


def check_aoti(args, device: str) -> list[dict]:
    """Build a tiny Llama's AOTInductor packages (lowered; dense; dense with its constants inside the
    library) and load and run each in a child process, whose crash is a row: its exit signal, the last
    stage it announced and the head of its traceback (faulthandler); the first crash is diagnosed
    further (``_aoti_diagnose``)."""
    if device != "cuda":
        return [{"section": "aoti", "variant": "skipped", "passed": True, "note": "needs a CUDA GPU"}]
    rows = []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    diagnosed = False
    for variant in args.aoti_variants.split(","):
        with tempfile.TemporaryDirectory(prefix="gmc-aoti-") as out:
            row = {"section": "aoti", "variant": variant}
            print(f"aoti {variant}: build", flush=True)
            built = subprocess.run([sys.executable, "-c", _AOTI_BUILD, out, variant], env=env, capture_output=True,
                                   text=True, timeout=300)
            row["build_rc"] = built.returncode
            if built.returncode:
                row.update(passed=False, error=built.stderr[-1500:])
            else:
                row["build_s"] = json.loads(built.stdout.strip().splitlines()[-1])["build_s"]
                print(f"aoti {variant}: built in {row['build_s']:.0f} s; load", flush=True)
                loaded = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _AOTI_LOAD, out, variant], env=env,
                                        capture_output=True, text=True, timeout=180)
                row["load_rc"] = loaded.returncode
                row["stage"] = (loaded.stdout.strip().splitlines() or ["(none)"])[-1][:200]
                if loaded.returncode == 0:
                    row["rel_error"] = json.loads(row["stage"])["rel_error"]
                    row["passed"] = row["rel_error"] < 3e-2
                else:  # faulthandler's traceback first, then the extension modules it lists
                    row.update(passed=False, error=loaded.stderr[:2500])
                    if not diagnosed:
                        row.update(_aoti_diagnose(out, env, variant))
                        diagnosed = True
                        toolchain = {k: row[k] for k in ("cxx", "wrapper_libstdcxx_symbols", "wrapper_libstdcxx")
                                     if k in row}
                        print(f"aoti {variant}: bare load rc {row['bare_load_rc']}; {toolchain}\n"
                              f"{row.get('backtrace', '')}", flush=True)
            rows.append(row)
            print(f"{'PASS' if row['passed'] else 'FAIL'} aoti {variant}: build rc {row['build_rc']}"
                  + (f" ({row['build_s']:.0f} s)" if "build_s" in row else "")
                  + (f", load rc {row['load_rc']} after '{row['stage']}'" if "load_rc" in row else "")
                  + (f", decode logits rel error {row['rel_error']:.2e}" if "rel_error" in row else "")
                  + (f"\n{row['error'][:1500]}" if "error" in row else ""), flush=True)
    return rows


# ------------------------------------------------------------------------------ mask learning


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

        def until(k):  # seconds from the first step's start to step k's end
            return tokens * k / log[k - 1]["tok_per_s"]

        half = steps // 2
        steady = (until(steps) - until(half)) / (steps - half)
        training = artifact.manifest["training"]
        row = {"section": "learn", "model": "tiny llama" if args.tiny else "SmolLM2-135M shape, random weights",
               "precision": training["precision"], "compiled": training["compiled"], "batch": batch,
               "seq_len": seq_len, "steps": steps, "first_step_s": until(1), "step_ms": 1e3 * steady,
               "tokens_per_s": tokens / steady, "wall_s": wall,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
               "sparsity": artifact.manifest["global_sparsity"],
               "passed": (all(math.isfinite(r["loss"]) for r in log)
                          and abs(artifact.manifest["global_sparsity"] - 0.5) <= 0.01)}
        print(f"{'PASS' if row['passed'] else 'FAIL'} learn {row['precision']} "
              f"{'compiled' if row['compiled'] else 'eager'} "
              f"batch {batch} x {seq_len}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tok/s, first step "
              f"{row['first_step_s']:.1f} s, sparsity {row['sparsity']:.4f}"
              + (f", peak {row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else ""))
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ records for the docs


def records(report: dict, command: str, suffix: str = "") -> list[dict]:
    """``bench/results/gpu.json`` records (``bench/results_tables.py``) from a run's ``--json`` report,
    named ``cuda-<section><suffix>``."""
    gpu = next(iter(report.get("env", [])), {})
    host_info = {**report["host"], "gpu": report["device"], "triton": report["triton"],
                 "copy_gbps": None, "device_copy_gbps": round(gpu["copy_gbps"]) if gpu.get("copy_gbps") else None,
                 "bf16_gemm_tflops": round(gpu["gemm_tflops"]) if gpu.get("gemm_tflops") else None}
    common = {"bench": "bench/gpu_check.py", "command": command, "host": host_info}
    speed_columns = [
        {"key": "shape", "title": "layer"}, {"key": "group", "title": "group"}, {"key": "how", "title": "values"},
        {"key": "dtype", "title": "x"}, {"key": "tokens", "title": "tokens"},
        {"key": "dense_us", "title": "cuBLAS us", "format": "{:.1f}"},
        {"key": "lowered_us", "title": "lowered us", "format": "{:.1f}"},
        {"key": "speedup", "title": "cuBLAS / lowered", "format": "{:.2f}x"},
        {"key": "dense_gbps", "title": "cuBLAS GB/s", "format": "{:,.0f}"},
        {"key": "lowered_gbps", "title": "lowered GB/s", "format": "{:,.0f}"},
        {"key": "config", "title": "launch"}]
    out = []
    correctness = report.get("correctness", [])
    if correctness:
        passed = sum(r.get("passed", False) for r in correctness)
        out.append({**common, "name": "cuda-correctness" + suffix,
                    "title": (f"CUDA op vs F.linear in float64: {passed} of {len(correctness)} cases pass, "
                              f"{report['device']}"),
                    "columns": [{"key": k, "title": t} for k, t in (("group", "group"), ("how", "values"),
                                                                     ("shape", "layer"), ("dtype", "x"),
                                                                     ("tokens", "tokens"))]
                    + [{"key": "max_abs_err", "title": "max abs error", "format": "{:.2e}"},
                       {"key": "max_rel_err", "title": "max abs / max |ref|", "format": "{:.2e}"},
                       {"key": "result", "title": "result"}],
                    "rows": [{**r, "result": "PASS" if r["passed"] else "FAIL"} for r in correctness if "group" in r],
                    "notes": ["Tolerances |out - ref| <= atol + rtol |ref|: fp32 1e-4/1e-4, fp16 2e-3/2e-3, bf16 (and "
                              "int8/int4 values under bf16 or fp16 x) 1e-2/1e-2; the reference is the layer's own "
                              "dense weight (dequantized for int8/int4) in float64."]})
    for section, title in (("decode", "decode token counts"), ("prefill", "prefill token counts")):
        rows = [{**r, "dense_us": r["dense_ms"] * 1e3, "lowered_us": r["lowered_ms"] * 1e3}
                for r in report.get(section, []) if "dense_ms" in r]
        if rows:
            columns = speed_columns + ([{"key": "copy_share", "title": "lowered / copy GB/s", "format": "{:.0%}"}]
                                       if section == "decode" else
                                       [{"key": "dense_tflops", "title": "cuBLAS TFLOP/s", "format": "{:.0f}"}])
            out.append({**common, "name": f"cuda-{section}{suffix}",
                        "title": (f"CUDA op vs cuBLAS at {title}, LLaMA-2-7B shapes, 50% unless named, "
                                  f"{report['device']}"),
                        "columns": columns, "rows": rows,
                        "notes": ["Each side is one CUDA graph over copies of its weights that together span 3x the "
                                  "L2 cache, replays interleaved, medians (bench/cuda_timing.py). GB/s: bytes read "
                                  "and written (lowered: tiled values, entries, tile pointers, scales, x, y; cuBLAS: "
                                  "the dense weight, x, y) over time. int8/int4 rows: cuBLAS runs the bf16 dense "
                                  "weight. Above 1x the lowered op is faster."]})
    e2e = report.get("e2e", [])
    if e2e and "decode_ms" in e2e[0]:
        out.append({**common, "name": "cuda-e2e" + suffix,
                    "title": f"End to end, {e2e[0]['model']}, 1x256 at 50%, {report['device']}",
                    "columns": [{"key": "weights", "title": "weights"},
                                {"key": "weight_gib", "title": "weights GiB", "format": "{:.2f}"},
                                {"key": "decode_ms", "title": "decode ms/token (graph)", "format": "{:.2f}"},
                                {"key": "decode_speedup", "title": "decode x dense", "format": "{:.2f}x"},
                                {"key": "generate_tok_s", "title": "gmc loop tok/s", "format": "{:.1f}"},
                                {"key": "prefill_ms", "title": f"prefill {e2e[0]['prefill_tokens']} ms",
                                 "format": "{:.1f}"},
                                {"key": "prefill_speedup", "title": "prefill x dense", "format": "{:.2f}x"},
                                {"key": "greedy", "title": "greedy tokens = eager"},
                                *([{"key": "logits_rel_error", "title": "logits vs eager", "format": "{:.1e}"}]
                                  if any("logits_rel_error" in r for r in e2e) else [])],
                    "rows": [{**r, "greedy": f"{r['greedy_equal']}/{r['greedy_tokens']}" if "greedy_equal" in r else ""}
                             for r in e2e],
                    "notes": [f"Decode: {e2e[0]['new_tokens']} tokens after a {e2e[0]['prompt']}-token prompt, each "
                              "step one replay of a CUDA graph of the whole model (gmc.runtime.cuda_graph; attention "
                              "reads every cache slot under a mask); ms/token is the graph's GPU time, back to back; "
                              "'gmc loop' is the median step of gmc.runtime.generate (copies in, replay, sync, "
                              "argmax). Prefill: one eager call. The head and embeddings stay bf16 in every row."]})
    sweep = report.get("sweep", [])
    if sweep and "best_ms" in sweep[0]:
        from gmc.kernels.triton_group_sparse import KernelConfig

        out.append({**common, "name": "cuda-sweep" + suffix,
                    "title": f"Block sizes of the CUDA op at 50%, bf16 x, {report['device']}",
                    "columns": [{"key": "shape", "title": "layer"}, {"key": "group", "title": "group"},
                                {"key": "how", "title": "values"}, {"key": "tokens", "title": "tokens"},
                                {"key": "default_cfg", "title": "default"},
                                {"key": "default_speedup", "title": "default vs cuBLAS", "format": "{:.2f}x"},
                                {"key": "best_cfg", "title": "fastest"},
                                {"key": "best_speedup", "title": "fastest vs cuBLAS", "format": "{:.2f}x"}],
                    "rows": [{**r, "default_cfg": _short(KernelConfig(**r["default"])),
                              "best_cfg": _short(KernelConfig(**r["best"]))} for r in sweep],
                    "notes": ["T tokens, R rows, K input columns a program step (several blocks a step when "
                              "wider than one), w warps, s pipeline stages, x programs splitting a tile's entries. "
                              "Timed as the op rows."]})
    aoti = [r for r in report.get("aoti", []) if "build_rc" in r]
    if aoti:
        out.append({**common, "name": "cuda-aoti" + suffix,
                    "title": f"AOTInductor packages of a tiny Llama's decode programs, {report['device']}",
                    "columns": [{"key": "variant", "title": "package"},
                                {"key": "build_s", "title": "build s", "format": "{:.0f}"},
                                {"key": "load_rc", "title": "load exit code"},
                                *([{"key": "bare_load_rc", "title": "exit code, torch alone"},
                                   {"key": "crash_in", "title": "crashed in"}]
                                  if any("bare_load_rc" in r for r in aoti) else []),
                                {"key": "result", "title": "result"}],
                    "rows": [{**r, "crash_in": crash_frames(r.get("backtrace", "")),
                              "result": "runs" if r.get("passed") else "crashed" if r.get("load_rc", 0) < 0
                              else "failed"} for r in aoti],
                    "notes": ["Built with gmc.lower.compile.compile_programs in one child process, loaded "
                              "(torch._inductor.aoti_load_package, then load_constants) and run in another; "
                              "exit code -11 is a segmentation fault. 'torch alone': the load in a process that "
                              "imports torch and nothing else; 'crashed in': the innermost torch function and the "
                              "faulting one of the native backtrace (bench/segv_backtrace.c preloaded)."]})
    return out


def crash_frames(backtrace: str) -> str:
    """'outer <- inner' of a native backtrace (``segv_backtrace.c``): the innermost ``torch::`` function and
    the function that faulted, demangled where ``c++filt`` is at hand; '' without a backtrace."""
    symbols = re.findall(r"\(([^)+]+)\+0x", backtrace)
    symbols = [symbol for symbol in symbols if symbol != "on_fault"]
    if not symbols:
        return ""
    demangler = shutil.which("c++filt")
    if demangler is not None:
        symbols = subprocess.run([demangler], input="\n".join(symbols), capture_output=True, text=True,
                                 check=True).stdout.splitlines()
    short = [re.sub(r"\(.*", "", symbol) for symbol in symbols]  # names without argument lists
    torch_frame = next((name for name in short if name.startswith("torch::")), "?")
    return f"{torch_frame} <- {short[0]}"


# ------------------------------------------------------------------------------ main


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
        print(f"FAIL {name}: {type(error).__name__}: {first}", flush=True)
        import traceback

        traceback.print_exc(limit=6)
        return [{"section": name, "passed": False, "error": f"{type(error).__name__}: {first}"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="small shapes and token counts (for TRITON_INTERPRET=1 on CPU)")
    parser.add_argument("--dtypes", help="comma-separated, e.g. float16,bfloat16, for the correctness section "
                                         "(default: all three)")
    parser.add_argument("--tokens", help="comma-separated token counts for the correctness section "
                                         "(default 1,16,256,2048; --tiny: 1,5,33)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated, any of {', '.join(SECTIONS)} (default: all but learn)")
    parser.add_argument("--sweep", default="decode,prefill", choices=("decode,prefill", "decode", "prefill"),
                        help="what the sweep section times (default both)")
    parser.add_argument("--aoti-variants", default=",".join(AOTI_VARIANTS),
                        help="comma-separated packages the aoti section builds, of: " + ", ".join(AOTI_VARIANTS))
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="skip a section that could not finish within this many seconds of the start")
    parser.add_argument("--json", metavar="PATH", help="write every row of every section here (after each section)")
    parser.add_argument("--records", metavar="REPORT", help="write bench/results/gpu.json's records from a --json "
                                                            "report, then exit (needs no GPU)")
    parser.add_argument("--suffix", default="", help="with --records: appended to the record names")
    parser.add_argument("--results", metavar="PATH", help="with --records: the records file to write "
                                                          "(default bench/results/gpu.json)")
    args = parser.parse_args()
    if args.records:
        from records import RESULTS, write_record

        report = json.loads(Path(args.records).read_text())
        target = Path(args.results) if args.results else RESULTS / "gpu.json"
        for record in records(report, report.get("command", "python bench/gpu_check.py"), args.suffix):
            write_record(target, record)
            print(f"{target}: {record['name']}")
        return
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
    if unknown := [v for v in args.aoti_variants.split(",") if v not in AOTI_VARIANTS]:
        parser.error(f"bad --aoti-variants {','.join(unknown)}: expected any of {', '.join(AOTI_VARIANTS)}")
    import triton

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    mode = "; TRITON_INTERPRET=1 (interpreter)" if interpret else ""
    print(f"device: {where}{mode}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    started = time.perf_counter()
    rows = {name: [] for name in SECTIONS}
    copy_bw = None
    runs = {"env": lambda: check_env(plan, device, args),
            "correctness": lambda: check_correctness(plan, device, args.seed),
            "decode": lambda: check_decode(plan, device, args.seed, copy_bw),
            "prefill": lambda: check_prefill(plan, device, args.seed),
            "e2e": lambda: check_e2e(plan, device, args.seed),
            "sweep": lambda: check_sweep(plan, device, args.seed, tuple(args.sweep.split(","))),
            "aoti": lambda: check_aoti(args, device),
            "learn": lambda: check_learning(args, device)}
    report = {"device": where, "host": host(), "interpreter": interpret, "torch": torch.__version__,
              "triton": triton.__version__, "seed": args.seed, "plan": asdict(plan),
              "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:])}
    for name in SECTIONS:
        if name not in sections:
            continue
        elapsed = time.perf_counter() - started
        if elapsed + SECTION_SECONDS[name] > args.budget_s:
            print(f"\n## {name}: skipped ({elapsed:.0f} s gone of a {args.budget_s:.0f} s budget)", flush=True)
            rows[name] = [{"section": name, "skipped": True}]
            continue
        print(f"\n## {name} ({elapsed:.0f} s)", flush=True)
        rows[name] = _section(name, runs[name])
        if name == "env" and rows["env"] and rows["env"][0].get("copy_gbps"):
            copy_bw = rows["env"][0]["copy_gbps"]
        if args.json:
            Path(args.json).write_text(json.dumps({**report, **rows}, indent=1))
    checks = [row for section in rows.values() for row in section if "passed" in row]
    failed = sum(not row["passed"] for row in checks)
    print(f"\nchecks: {len(checks) - failed}/{len(checks)} passed; {time.perf_counter() - started:.0f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
