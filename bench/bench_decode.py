"""End-to-end CPU decode and prefill: compiled lowered vs compiled dense, both through one path.

Every compiled row is the same pipeline (``gmc.graph.pipeline.lower_decode`` -> ``gmc.formats.compiled``):
prefill and decode programs over a static KV cache, AOTInductor-compiled, driven by gmc's own
step loop; the lowered rows differ only by the lowering pass. HF eager dense (``model(...)`` with
its dynamic cache) is the second reference. The lowered rows hold the masked model (random group
masks, or ``--artifact`` masks and weights), the dense rows the unpruned one, so their perplexities
are the two ends of pruning and their speeds depend only on what is read. ``--peer llamacpp`` adds
llama.cpp on the same GGUF the bundled model ships as, requantized to F32, F16, Q8_0, Q4_0 and Q4_1
(``peer_llamacpp.py``); ``--peer genai`` adds onnxruntime-genai running its model builder's fp32
and int4 exports of the dense model, the int4 one also with the head int8 as gmc's and
llama.cpp's (``peer_genai.py``). Each peer row is timed in a process of its own (``time_in_child``:
the same loops, in turn with gmc's rows: ``--rounds`` below): a peer's thread pool keeps polling after
its call, and in one process with it the row timed next ran slower (llama.cpp's pool slowed
gmc's compiled steps; ONNX Runtime's pool and torch's OpenMP threads took the two cores from each
other, 2-thread rows up to 2x slower). Their perplexities still go through their logits in this
process.

``--march x86-64-v3`` runs the whole bench as an AVX2-only host would on an AVX-512 one: gmc's
kernel built for x86-64-v3, torch, MKL and oneDNN on their AVX2 code (``host.AVX2_ENV``) and
llama.cpp built for AVX2 alone (``peer_llamacpp.use_build``). onnxruntime picks its kernels by
the CPU it finds, so its rows keep this host's AVX-512 ones; the record names both.

Per row: decode ms/token (the median step of the row's ``--new-tokens`` steps, run back to back as a
generate loop runs them and as each peer's process runs its own, the rows one after another, from
another row each round; ``--interleave-steps``: one step of each row in turn, where every step
follows another model's step, as no user's loop runs it: docs/speed.md, "Decode steps back to back"),
prefill ms for ``--prefill`` tokens (median, interleaved), the weight bytes one decode step reads, the
achieved weight-streaming GB/s, and that as a fraction of a memory-copy roofline measured in the
same run (``copy_`` of 256 MiB: bytes read + written over time, same threads). Each thread count
runs ``--rounds`` rounds: gmc's rows in this process and each peer's process in turn, the peers
first in every other round, the copy measured just before and after each round's decode loop. A row
reports the median of its rounds, and its share of the copy is the median of each round's share of
that round's copy: a 2-core cloud host whose two-thread speed moves between levels from minute to
minute then puts each level into every row, where one pass would have timed gmc's rows in one level
and a peer's in another. The KV cache
(attention reads the filled positions only) is not counted in the bytes. Every compiled row runs
its output head on gmc's kernel, all groups kept (``lower_decode``'s default; ``--no-head``: MKL's
GEMV in every row); ``--gmc-dense`` adds the strongest dense baseline, every projection on gmc's
kernel too. ``--int8`` / ``--int4`` add dense and lowered rows with weight-only int8 / int4 kept
values (the head int8 in both).

The base of every speed ratio is the fastest dense row of the row's own precision in the same
run (fp32: compiled dense on MKL or on gmc's kernel, llama.cpp F32; int8: gmc's dense int8,
llama.cpp Q8_0; int4: gmc's dense int4, llama.cpp Q4_0 and Q4_1), for decode and prefill apart.

``gmc bench`` (``gmc.runtime.bench``) times what a user has on disk (model, masks artifact, lowered
or compiled directory, ONNX file) through ``gmc generate``'s steps and loop; this script builds its
rows in memory and keeps its own loops, and the two decode figures differ in protocol: here a
``--prompt`` of 32 tokens is prefilled untimed, then each row runs ``--new-tokens`` 48 decode steps,
the first 2 dropped as warm-up, and a row reports the median step (ms/token);
``gmc bench``'s tg starts from 1 token as llama-bench's does, times all ``-n`` 64 steps of a row in
one go, interleaves rows per repetition (after ``--warmup`` untimed runs) and reports the mean and
std over ``-r`` repetitions of steps / total seconds, so a slow step counts where a median hides
it. Prefill is the same measurement (256 tokens into an empty cache), median over 5 here, mean ±
std over ``-r`` there.

    python bench/bench_decode.py --threads 1 2                  # SmolLM2-135M, 1x256 at 50%
    python bench/bench_decode.py --dtypes float32 bfloat16 --int8 --gmc-dense --ppl --artifact runs/gm/artifact
    python bench/bench_decode.py --model llama2-stack           # two LLaMA-2-7B decoder layers
    python bench/bench_decode.py --threads 1 2 --gmc-dense --int8 --int4 --peer llamacpp --ppl --record peers
    python bench/bench_decode.py --threads 1 2 --gmc-dense --int8 --int4 --peer llamacpp genai --march x86-64-v3
    python bench/bench_decode.py --artifact runs/gm-50 --more-artifacts runs/gm-40 runs/gm-30 --int4 --ppl  # the front
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from host import MARCH_HELP, copy_bandwidth_gbs, host, run_as

from gmc.formats.artifact import load_artifact
from gmc.formats.compiled import load_compiled
from gmc.graph.decode import KVCache
from gmc.graph.pipeline import LowerOptions, lower, lower_decode
from gmc.graph.targets import eager_targets
from gmc.groups import parse_pattern
from gmc.kernels.cpu_group_sparse import MARCHES, march
from gmc.kernels.group_sparse_linear import cpu_backend
from gmc.kernels.linear import swap_group_sparse_linears
from gmc.kernels.packed import pack_dense
from gmc.kernels.quantize import quantize
from gmc.lower.compile import compile_programs


@dataclass
class Row:
    label: str
    steps: dict  # prefill/decode callables
    weight_bytes: int
    precision: str = "fp32"  # of the stored weights: fp32, bf16, fp16, int8, int4
    dense: bool = True  # every weight kept: a candidate base of its precision's ratios
    close: object = None  # callable() that frees a peer's model
    child: tuple = ()  # (kind, path): timed in a process of its own (time_in_child), not in the interleaved loops
    compile_s: float = 0.0
    decode_ppl: float = float("nan")
    decode_s: float = float("nan")
    prefill_s: float = float("nan")
    ppl: float = float("nan")
    of_copy: float = float("nan")  # weight bytes / decode_s over the copy roofline, median of the rounds' own
    rounds_ms: tuple = ()  # ([decode ms], [prefill ms]), a figure a round


def all_kept(model: torch.nn.Module, names, pattern) -> dict:
    """Every named linear packed with all its groups kept (``pack_dense``): a dense layer in the
    packed layout, so ``quantize`` of it is dense int8 (int4) weight-only on the same kernel and the
    same scale granularity as the lowered int8 (int4) rows. The rival
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
        return load_artifact(artifact).masks
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.rand(pattern.grid(t.shape), generator=gen) >= sparsity for t in eager_targets(model)}


def compiled_row(label: str, model, packed: dict, max_len: int, scratch: str, weight_bytes: int, head: bool,
                 fuse: bool = LowerOptions.fuse, quantized: str = "none") -> Row:
    start = time.perf_counter()
    programs = lower_decode(model, packed, max_len, LowerOptions(quantize=quantized, head=head, fuse=fuse))
    directory = f"{scratch}/{label.replace(' ', '-').replace(',', '')}"
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
def time_decode(rows: list[Row], config, max_len: int, dtype, prompt: torch.Tensor, steps: int,
                interleave: bool = False, first: int = 0) -> None:
    """Median seconds per decode step of each row (the first 2 steps dropped). Each row runs its
    ``steps`` back to back, as a generate loop does and as a peer's own process does
    (``time_in_child``), the rows one after another from row ``first``; ``interleave``: one step of
    each row in turn instead, so that every step follows another model's step."""
    order = rows[first % len(rows):] + rows[:first % len(rows)] if rows else []
    state = {}
    for row in order:
        cache = KVCache.empty(config, max_len, dtype)
        logits = row.steps["prefill"](prompt, torch.tensor(0), cache.keys, cache.values)
        state[row.label] = [cache, prompt.shape[1], logits.argmax(-1, keepdim=True)]
    times = {row.label: [] for row in order}

    def step(row: Row) -> None:
        cache, position, token = state[row.label]
        start = time.perf_counter()
        logits = row.steps["decode"](token, torch.tensor(position), cache.keys, cache.values)
        times[row.label].append(time.perf_counter() - start)
        state[row.label][1:] = [position + 1, logits.argmax(-1, keepdim=True)]

    if interleave:
        for _ in range(steps):
            for row in order:
                step(row)
    else:
        for row in order:
            for _ in range(steps):
                step(row)
    for row in order:
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
    weights = load_weights(args.artifact)
    dense = copy.deepcopy(model)  # the unpruned model: the dense rows
    _, packed = lower(model, masks, pattern, weights)  # the kept groups of the (learned) weights
    dense.to(dtype)
    model.to(dtype)
    packed = {name: layer.to(dtype=dtype) for name, layer in packed.items()}
    head = [name for name, module in dense.named_modules() if module is dense.get_output_embeddings()]
    # the output head as lower_decode(head=args.head) runs it, for each row's eager twin (bytes, perplexity)
    head_float = all_kept(dense, head, pattern) if args.head else {}
    precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype_name]
    hows = [how for how in ("int8", "int4") if getattr(args, how)]
    # under int8 and int4 targets the head is int8 (LowerOptions), in every row
    head_q = {name: quantize(layer, "int8") for name, layer in all_kept(dense, head, pattern).items()} if hows else {}

    def variant(label: str, traced, layers: dict, how: str, is_dense: bool) -> tuple:
        """(label, the eager twin, the model lower_decode traces, the layers it takes, values stored as,
        dense); the head as lower_decode makes it, or passed in with --no-head under int8 / int4."""
        heads = head_float if how == "none" else head_q
        twin = swap_group_sparse_linears(copy.deepcopy(traced), {**layers, **heads})
        return label, twin, traced, layers if args.head or how == "none" else {**layers, **heads}, how, is_dense

    variants = [variant("compiled dense", dense, {}, "none", True),
                variant("compiled lowered", model, packed, "none", False)]
    if args.gmc_dense:  # the strongest dense baseline: every projection on gmc's kernel too, all groups kept
        variants.insert(1, variant("compiled dense, gmc kernel", dense, all_kept(dense, packed, pattern), "none", True))
    for how in hows:  # every target quantized as `how`; dense keeps all groups
        dense_q = {name: quantize(layer, how) for name, layer in all_kept(dense, packed, pattern).items()}
        variants += [variant(f"compiled dense {how}", dense, dense_q, how, True),
                     variant(f"compiled lowered {how}", model,
                             {name: quantize(layer, how) for name, layer in packed.items()}, how, False)]
    for path in args.more_artifacts:  # more learned masks: their lowered rows, labelled with their sparsity
        artifact = load_artifact(path)
        traced = copy.deepcopy(dense)  # the unpruned model, traced with this artifact's packed layers
        _, extra = lower(traced, artifact.masks, pattern, artifact.weights or None)
        extra = {name: layer.to(dtype=dtype) for name, layer in extra.items()}
        sparsity = f"{artifact.manifest['target_sparsity']:.0%}"
        for how in ["none", *hows]:
            layers = extra if how == "none" else {name: quantize(layer, how) for name, layer in extra.items()}
            variants.append(variant(" ".join(["compiled lowered", *([how] if how != "none" else []), sparsity]),
                                    traced, layers, how, False))
    if args.lowered_only:
        variants = [variant for variant in variants if not variant[-1]]
    max_len = max(args.prefill, args.prompt + args.new_tokens) + 8
    # llama.cpp first: it fails fast (not installed, another model) where the compiled rows take minutes
    peers = peer_rows(args, dense, tokenizer, max_len, scratch) if args.peer and dtype_name == "float32" else []
    hf = _EagerHF(dense)
    rows = [] if args.lowered_only else [Row("HF eager dense", {"prefill": hf, "decode": hf}, weight_bytes(dense),
                                              precision)]
    for label, twin, traced, layers, how, is_dense in variants:
        row = compiled_row(label, traced, layers, max_len, scratch, weight_bytes(twin), args.head, args.fuse, how)
        row.precision, row.dense = (precision if how == "none" else how), is_dense
        if args.ppl and tokenizer is not None:
            row.ppl = heldout_ppl(twin, tokenizer)
        rows.append(row)
    if not args.lowered_only:
        rows[0].ppl = rows[1].ppl
    rows += peers
    gen = torch.Generator().manual_seed(1)
    vocab = dense.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    long_ids = torch.randint(0, vocab, (1, args.prefill), generator=gen)
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        in_process = [row for row in rows if not row.child]
        samples = {row.label: [] for row in rows}  # (decode_s, prefill_s, the round's copy bytes/s) a round
        copies = []  # the copy before and after the in-process decode loop, a round
        def time_peers() -> dict:
            return {row.label: time_in_child(args, *row.child, threads) for row in rows if row.child}

        for round_ in range(args.rounds):
            # the peers first in every other round: neither side always runs after the other
            timed = time_peers() if round_ % 2 else {}
            before = copy_roofline()
            time_decode(in_process, dense.config, max_len, dtype, prompt, args.new_tokens, args.interleave_steps,
                        first=round_)
            after = copy_roofline()
            copies.append((before, after))
            time_prefill(in_process, dense.config, max_len, dtype, long_ids, args.prefill_repeats)
            if not round_ % 2:
                timed = time_peers()
            seconds = {row.label: {"decode_s": row.decode_s, "prefill_s": row.prefill_s} for row in in_process}
            seconds |= timed
            for row in rows:
                samples[row.label].append((seconds[row.label]["decode_s"], seconds[row.label]["prefill_s"],
                                           (before + after) / 2))
        for row in rows:
            decode, prefill, copied = zip(*samples[row.label])
            row.decode_s, row.prefill_s = statistics.median(decode), statistics.median(prefill)
            row.of_copy = statistics.median(row.weight_bytes / d / c for d, c in zip(decode, copied))
            row.rounds_ms = [[d * 1e3 for d in decode], [p * 1e3 for p in prefill]]
        roofline = statistics.median((before + after) / 2 for before, after in copies)
        results += [{**r, "copy_rounds_gb_s": [[before / 1e9, after / 1e9] for before, after in copies]}
                    for r in _results(rows, roofline, model_label, threads, dtype_name)]
        split = time_split(packed, next(iter(head_float.values()), dense.get_output_embeddings().weight), dtype)
        lowered = next(r for r in results[::-1] if r["row"] == "compiled lowered")
        results[-1]["split"] = {**split, "calls": len(packed),
                                "rest": lowered["decode_ms"] - split["projections"] - split["lm_head"]}
    if args.decode_ppl and tokenizer is not None:  # every compiled and peer row, one token a step
        ids = heldout_ids(tokenizer)[: args.decode_ppl + 1]
        for row in rows:
            if row.label != "HF eager dense" and row.steps:
                row.decode_ppl = decode_perplexity(row, dense.config, max_len, dtype, ids)
        by_label = {row.label: row for row in rows}
        for result in results:
            result["decode_ppl"] = by_label[result["row"]].decode_ppl
    for peer in peers:
        if peer.close is not None:
            peer.close()
    return results


DECODE_WINDOW = 256  # tokens a decode-perplexity window: the first is prefilled, each next one decoded


def heldout_ids(tokenizer) -> torch.Tensor:
    from gmc.runtime.evaluate import load_document

    return torch.tensor(tokenizer(load_document("bundled-heldout")[0])["input_ids"])


@torch.no_grad()
def decode_perplexity(row: Row, config, max_len: int, dtype, ids: torch.Tensor) -> float:
    """Perplexity of ``ids`` scored as generation computes it: windows of ``DECODE_WINDOW`` tokens,
    the first token prefilled and every next one predicted by a one-token decode step (where int4
    layers quantize x to int8, and llama.cpp its activations)."""
    nll, count = 0.0, 0
    for begin in range(0, len(ids) - 1, DECODE_WINDOW):
        window = ids[begin: begin + DECODE_WINDOW + 1]
        cache = KVCache.empty(config, max_len, dtype)
        logits = row.steps["prefill"](window[None, :1], torch.tensor(0), cache.keys, cache.values)
        for i in range(1, len(window)):
            nll -= float(torch.log_softmax(logits.float(), dim=-1)[0, window[i]])
            count += 1
            if i + 1 < len(window):
                logits = row.steps["decode"](window[None, i: i + 1], torch.tensor(i), cache.keys, cache.values)
    return math.exp(nll / count)


def load_weights(artifact: str | None):
    """The artifact's learned weights (``--learn-weights``, ``gmc recover``), or None."""
    if not artifact:
        return None
    return load_artifact(artifact).weights or None


def peer_rows(args, model, tokenizer, max_len: int, scratch: str) -> list[Row]:
    """The ``--peer`` rows: llama.cpp's (``llamacpp_rows``) and onnxruntime-genai's (``genai_rows``)."""
    if args.model != "smollm2-135m":
        raise SystemExit("bench_decode: --peer runs the bundled model's own files: use --model smollm2-135m")
    return ((llamacpp_rows(args, tokenizer, max_len) if "llamacpp" in args.peer else [])
            + (genai_rows(args, model, tokenizer, Path(scratch)) if "genai" in args.peer else []))


def llamacpp_rows(args, tokenizer, max_len: int) -> list[Row]:
    """llama.cpp on the bundled GGUF requantized to each of ``peer_llamacpp.FORMATS``."""
    import peer_llamacpp

    peer_llamacpp.use_build(march())
    if not peer_llamacpp.available():
        raise SystemExit("bench_decode: --peer llamacpp needs llama-cpp-python: pip install -e '.[peer]'")
    args.peer_info["llama.cpp"] = peer_llamacpp.system_info()
    rows = []
    for fmt in peer_llamacpp.FORMATS:
        path = peer_llamacpp.requantized(fmt)
        # timed in a child process; steps here only for --decode-ppl
        steps = peer_llamacpp.LlamaCppSteps(path, max_len, args.threads[-1]) if args.decode_ppl else None
        row = Row(f"llama.cpp {fmt}", steps.steps() if steps else {}, peer_llamacpp.tensor_types(path)["bytes"],
                  peer_llamacpp.PRECISION[fmt], close=steps.close if steps else None, child=("llamacpp", path))
        if args.ppl:
            row.ppl = peer_llamacpp.heldout_ppl(path, tokenizer, PPL_SEQ_LEN, args.threads[-1])
        rows.append(row)
    return rows


def genai_rows(args, model, tokenizer, scratch: Path) -> list[Row]:
    """onnxruntime-genai on its model builder's exports of ``model`` (dense: ``peer_genai.EXPORTS``),
    each row timed in a process of its own (``time_in_child``)."""
    import onnxruntime
    import peer_genai

    if not peer_genai.available():
        raise SystemExit("bench_decode: --peer genai needs onnxruntime-genai: pip install onnxruntime-genai")
    args.peer_info["onnxruntime"] = f"{onnxruntime.__version__}, kernels picked by the CPU it finds"
    hf_dir = scratch / "hf"
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    rows = []
    for export, (precision, _) in peer_genai.EXPORTS.items():
        directory = peer_genai.builder_export(hf_dir, export, scratch)
        row = Row(f"onnxruntime-genai {export}", {}, peer_genai.weight_bytes(directory), precision,
                  child=("genai", directory))
        if args.ppl:
            row.ppl = peer_genai.heldout_ppl(directory, tokenizer, PPL_SEQ_LEN, args.threads[-1])
        rows.append(row)
    return rows


def child_steps(kind: str, path: str, max_len: int, threads: int):
    """(steps, close) of one peer row: llama.cpp on a GGUF file, onnxruntime-genai on a directory."""
    if kind == "llamacpp":
        import peer_llamacpp

        peer_llamacpp.use_build(march())
        steps = peer_llamacpp.LlamaCppSteps(Path(path), max_len, threads)
        return steps.steps(), steps.close
    from gmc.runtime.bench import GenaiStep

    step = GenaiStep(Path(path), max_len, threads)
    return {"prefill": step, "decode": step}, None


def time_row(args) -> None:
    """In a process of its own (``--time-row KIND PATH``): one peer row's decode and prefill seconds
    on ``--threads``, through ``time_decode`` and ``time_prefill``, printed as JSON."""
    from transformers import LlamaConfig

    kind, path = args.time_row
    # the loops allocate gmc's KV cache for a config; the peers keep their own: a small one
    config = LlamaConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
    max_len = max(args.prefill, args.prompt + args.new_tokens) + 8
    steps, close = child_steps(kind, path, max_len, args.threads[0])
    row = Row("row", steps, 0)
    gen = torch.Generator().manual_seed(1)
    vocab = 1000  # token ids every tokenizer here has
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    long_ids = torch.randint(0, vocab, (1, args.prefill), generator=gen)
    time_decode([row], config, max_len, torch.float32, prompt, args.new_tokens)
    time_prefill([row], config, max_len, torch.float32, long_ids, args.prefill_repeats)
    if close is not None:
        close()
    print(json.dumps({"decode_s": row.decode_s, "prefill_s": row.prefill_s}))


def add_protocol_options(parser) -> None:
    """The timing loops' options (``time_decode``, ``time_prefill``), which ``time_in_child`` hands on:
    every script that times rows through them takes these."""
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--interleave-steps", action="store_true",
                        help="time decode one step of each in-process row in turn (every step after another "
                             "model's) instead of each row's steps back to back")
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--prefill-repeats", type=int, default=5)


def time_in_child(args, kind: str, path, threads: int) -> dict:
    """``time_row`` of one peer row in a child process on ``threads`` threads (this process's
    environment: the same -march): ``{"decode_s", "prefill_s"}``."""
    import os
    import subprocess

    command = [sys.executable, str(Path(__file__).resolve()), "--time-row", kind, str(path),
               "--threads", str(threads), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--prefill", str(args.prefill), "--prefill-repeats", str(args.prefill_repeats)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        raise SystemExit(f"bench_decode: timing {kind} {path} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


PPL_SEQ_LEN = 512  # held-out perplexity windows (docs/quality.md's protocol)


def heldout_ppl(model: torch.nn.Module, tokenizer) -> float:
    """Perplexity on the bundled held-out text, ``PPL_SEQ_LEN``-token windows."""
    from gmc.runtime.evaluate import perplexity

    return perplexity(model, tokenizer, "bundled-heldout", seq_len=PPL_SEQ_LEN, progress=False).perplexity


def fastest_dense(rows: list[Row], precision: str, attribute: str) -> Row:
    """The dense row of ``precision`` with the least ``attribute`` (decode_s or prefill_s); without
    one (``--lowered-only``) a row of no time, whose ratios are NaN."""
    candidates = [row for row in rows if row.dense and row.precision == precision]
    return min(candidates, key=lambda row: getattr(row, attribute)) if candidates else Row("-", {}, 0)


def _results(rows, roofline, model_label, threads, dtype_name) -> list[dict]:
    results = []
    for row in rows:
        decode_base, prefill_base = (fastest_dense(rows, row.precision, key) for key in ("decode_s", "prefill_s"))
        gbs = row.weight_bytes / row.decode_s / 1e9
        share = gbs / (roofline / 1e9) if math.isnan(row.of_copy) else row.of_copy
        results.append({
            "model": model_label, "threads": threads, "dtype": dtype_name, "row": row.label,
            "precision": row.precision, "dense": row.dense,
            "decode_ms": row.decode_s * 1e3, "tok_s": 1 / row.decode_s, "prefill_ms": row.prefill_s * 1e3,
            "weight_mib": row.weight_bytes / 2**20,
            "gb_s": gbs, "roofline_gb_s": roofline / 1e9, "of_roofline": share, "rounds_ms": row.rounds_ms,
            "decode_base": decode_base.label, "decode_speedup": decode_base.decode_s / row.decode_s,
            "prefill_base": prefill_base.label, "prefill_speedup": prefill_base.prefill_s / row.prefill_s,
            "compile_s": row.compile_s, "bytes_bound": decode_base.weight_bytes / row.weight_bytes, "ppl": row.ppl,
        })
    return results


COLUMNS = [("threads", "threads", "{:.0f}"), ("row", "row", None), ("precision", "weights", None),
           ("decode_ms", "decode ms/token", "{:.1f}"), ("tok_s", "tok/s", "{:.1f}"),
           ("decode_speedup", "decode x base", "{:.2f}x"), ("decode_base", "decode base", None),
           ("prefill_ms", "prefill ms", "{:.0f}"), ("prefill_speedup", "prefill x base", "{:.2f}x"),
           ("prefill_base", "prefill base", None),
           ("weight_mib", "weights MiB/step", "{:.0f}"), ("gb_s", "GB/s", "{:.1f}"),
           ("of_roofline", "of copy roofline", "{:.0%}"), ("ppl", "held-out ppl", "{:.2f}"),
           ("decode_ppl", "decode ppl", "{:.2f}")]


def cell(row: dict, key: str, form: str | None) -> str:
    """One table cell: a number in its form, "-" where the run has none (no perplexity asked for, no
    dense base under --lowered-only)."""
    if form is None:
        return str(row[key])
    value = row.get(key, math.nan)
    return "-" if isinstance(value, float) and math.isnan(value) else form.format(value)


def render(results: list[dict], args) -> str:
    lines = [caption(results, args), "",
             "| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        lines.append("| " + " | ".join(cell(r, key, value) for key, _, value in COLUMNS) + " |")
    lines.append("")
    for r in results:
        if "split" in r:
            lines.append(f"compiled lowered decode, {r['threads']} thread(s) {r['dtype']}, ms/token: projections "
                         f"{r['split']['projections']:.1f} (the {r['split']['calls']} op calls alone, timed apart), "
                         f"lm_head {r['split']['lm_head']:.1f} "
                         f"(alone), rest {r['split']['rest']:.1f} (the step minus both: attention over the cache, "
                         f"norms, rotary, call overheads; approximate, the parts are timed outside the program)")
    lines.append(BASE_NOTE)
    return "\n".join(lines)


ROUNDS_NOTE = ("{rounds} rounds a thread count; a round times every in-process row (decode, then prefill) and "
               "every peer's process, the peers first in every other round; a row's figure is the median of its "
               "rounds' (rounds_ms: [decode], [prefill] ms a round). copy_gbps: a 256 MiB copy_ (bytes read + "
               "written / time), median over the rounds of the mean of one before and one after the round's "
               "decode loop; of copy roofline: the median of each round's row streaming rate over that round's copy")
BASE_NOTE = ("base: the fastest dense row of the row's weight precision in the same run (decode and prefill "
             "apart); the lowered rows hold the masked model, the dense rows the unpruned one")


def masks_caption(args) -> str:
    """What the lowered rows hold: each artifact's group and sparsity (its manifest's), else the random masks'."""
    if not args.artifact:
        return f"{args.group} at {args.sparsity:.0%} (random masks)"
    described = []
    for path in [args.artifact, *args.more_artifacts]:
        manifest = load_artifact(path).manifest
        described.append(f"{manifest['group']} at {manifest['global_sparsity']:.0%} (masks of {path})")
    return "; ".join(described)


def caption(results: list[dict], args) -> str:
    roofline = sorted({(r["threads"], round(r["roofline_gb_s"], 1)) for r in results})
    copies = {r["threads"]: r["copy_rounds_gb_s"] for r in results if "copy_rounds_gb_s" in r}
    return (f"{results[0]['model']}, {masks_caption(args)}, batch 1, "
            f"prompt {args.prompt}, {args.new_tokens} decode steps "
            f"({'one step of each row in turn' if args.interleave_steps else 'each row back to back'}), "
            f"prefill {args.prefill} tokens; "
            f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}); "
            f"op CPU path: {cpu_backend()}; "
            + "".join(f"{name}: {info}; " for name, info in getattr(args, "peer_info", {}).items())
            + "copy roofline GB/s by threads: " + ", ".join(f"{t}: {g}" for t, g in roofline)
            + (" (before / after each round's decode loop: "
               + "; ".join(f"{t}: " + ", ".join(f"{b:.1f} / {a:.1f}" for b, a in pairs) for t, pairs in copies.items())
               + ")" if copies else ""))


def write_record(results: list[dict], args, command: str) -> None:
    """This run as record ``args.record`` of bench/results/decode.json."""
    from records import save_record

    roofline = {r["threads"]: round(r["roofline_gb_s"], 1) for r in results}
    save_record("decode", {
        "name": args.record, "title": caption(results, args).split(";")[0], "bench": "bench/bench_decode.py",
        "command": command, "host": {**host(), "copy_gbps": [roofline[t] for t in sorted(roofline)],
                                     "threads": sorted(roofline)},
        # results_tables formats plain numbers: the roofline fraction is stored in percent
        "columns": [{"key": key, "title": title, **({"format": "{:.0f}%" if fmt == "{:.0%}" else fmt} if fmt else {})}
                    for key, title, fmt in COLUMNS],
        "rows": [{**{key: (r.get(key, float("nan")) * 100 if key == "of_roofline" else r.get(key, float("nan")))
                     for key, _, _ in COLUMNS}, "rounds_ms": r["rounds_ms"]}
                 for r in results],
        "notes": [BASE_NOTE + ".", ROUNDS_NOTE.format(rounds=args.rounds), caption(results, args)],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a HF ref, or llama2-stack")
    parser.add_argument("--group", default="1x256")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--artifact", default=None, help="use this masks artifact instead of random masks")
    parser.add_argument("--more-artifacts", nargs="+", default=[], metavar="PATH",
                        help="lowered rows of more masks artifacts too (the front: learned masks at other "
                             "sparsities), labelled with their target sparsity")
    add_protocol_options(parser)
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every row is timed per thread count, gmc's rows and the peers' processes in "
                             "turn (the peers first in every other round); a row reports the median of its rounds")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--int8", action="store_true", help="also dense int8 weight-only and lowered int8 rows")
    parser.add_argument("--int4", action="store_true", help="also dense int4 weight-only and lowered int4 rows")
    parser.add_argument("--peer", nargs="+", choices=["llamacpp", "genai"], default=[],
                        help="also llama.cpp rows on the bundled GGUF requantized (peer_llamacpp.py) and/or "
                             "onnxruntime-genai rows on its builder's fp32 and int4 exports (peer_genai.py); fp32 "
                             "tables only")
    parser.add_argument("--march", choices=MARCHES, default="native", help=MARCH_HELP)
    parser.add_argument("--decode-ppl", type=int, default=0, metavar="N",
                        help="also the perplexity of the first N held-out tokens decoded one token a step "
                             f"(windows of {DECODE_WINDOW}): what generation computes")
    parser.add_argument("--lowered-only", action="store_true",
                        help="only the lowered rows (no dense row: no ratios), "
                        "e.g. more sparsities for a quality-speed front")
    parser.add_argument("--record", default=None,
                        help="also write the rows as record NAME of bench/results/decode.json")
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
    parser.add_argument("--time-row", nargs=2, default=None, metavar=("KIND", "PATH"),
                        help=argparse.SUPPRESS)  # the child of time_in_child
    args = parser.parse_args()
    run_as(args.march)
    if args.time_row:
        return time_row(args)
    args.peer_info = {}
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="gmc-bench-decode-") as scratch:
        for dtype_name in args.dtypes:
            rows = bench(args, dtype_name, f"{scratch}/{dtype_name}")
            print(render(rows, args), "", sep="\n", flush=True)  # one table per dtype
            results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.record:
        write_record(results, args, command)


if __name__ == "__main__":
    main()
