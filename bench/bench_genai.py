"""onnxruntime-genai decode and prefill: gmc's ONNX lowering against the runtime's own exports.

Rows (``peer_genai.py``), each an ONNX model directory run by onnxruntime-genai's generator:

    onnxruntime-genai fp32 / int4        the model builder on the dense model (int4: MatMulNBits,
                                         block 32, int8 activations, the head 4-bit too)
    gmc onnx lowered (+ int4)            gmc lower --backend onnx [--quantize int4] of the same masks:
                                         the builder's graph, each pruned MatMul on gmc's native op
                                         (under int4 the head int8)
    gmc onnx lowered, standard ops       the same packing in standard ONNX ops

Each row is timed in a process of its own, which opens that one model
(``bench_decode.time_in_child``): ONNX Runtime's intra-op threads spin after a call, and with
several sessions (or torch's OpenMP threads, as in ``bench_decode.py``) in one process the spinning
pools took the two cores from each other (2-thread rows slower than 1-thread ones). Inside a row's
process the protocol is ``bench_decode.py``'s timing loops (a 32-token prompt prefilled untimed,
then 48 decode steps, the median step; a 256-token prefill, median of 5); ``--rounds`` runs every
row's process in turn that many times (row A, B, ..., then A again), and a row reports the median
over its rounds, so a drift of the host spreads over every row. Speed ratios are against the fastest
dense row of the same precision (the builder's exports); a copy roofline is measured in the same
run. Held-out perplexity goes through each directory's logits.

    python bench/bench_genai.py --threads 1 2 --ppl --record genai        # random 1x256 masks at 50%
    python bench/bench_genai.py --artifact runs/gm-1x256 --threads 2 --ppl
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from bench_decode import (
    PPL_SEQ_LEN,
    Row,
    _results,
    add_protocol_options,
    copy_roofline,
    load,
    masks_for,
    render,
    time_in_child,
    write_record,
)

from gmc.groups import parse_pattern


def genai_rows(args, dense, tokenizer, masks: dict, pattern, max_len: int, scratch: Path) -> list[Row]:
    """The builder's fp32 and int4 exports of the dense model, and ``gmc lower --backend onnx`` of
    ``masks`` (gmc's op, fp32 and int4; standard ops), each as a row."""
    import peer_genai

    from gmc.formats.artifact import MaskArtifact, build_manifest, model_fingerprint, save_artifact
    from gmc.lower.stage import LowerConfig, lower_artifact

    if not peer_genai.available():
        raise SystemExit("bench_genai: needs onnxruntime-genai: pip install onnxruntime-genai")
    hf_dir = scratch / "hf"
    dense.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    shapes = {name: tuple(dense.get_submodule(name).weight.shape) for name in masks}
    manifest = build_manifest(model_ref=args.model, fingerprint=model_fingerprint(dense), pattern=pattern,
                              masks=masks, shapes=shapes, method="random" if not args.artifact else "artifact",
                              allocation="uniform", target_sparsity=args.sparsity, calibration="none", seed=0)
    artifact = args.artifact or str(save_artifact(scratch / "masks", MaskArtifact(masks, manifest)))
    directories = {f"onnxruntime-genai {p}": (peer_genai.builder_export(hf_dir, p, scratch), p, True)
                   for p in ("fp32", "int4")}  # the exports of the genai record
    for label, options in (("gmc onnx lowered", {}), ("gmc onnx lowered int4", {"quantize": "int4"}),
                           ("gmc onnx lowered, standard ops", {"onnx_standard_ops": True})):
        out = scratch / label.replace(" ", "-").replace(",", "")
        lower_artifact(LowerConfig(artifact, str(out), backend="onnx", progress=False, **options))
        directories[label] = (out, options.get("quantize", "fp32"), False)
    rows = []
    for label, (directory, precision, is_dense) in directories.items():
        row = Row(label, {}, peer_genai.weight_bytes(directory), precision, dense=is_dense, child=("genai", directory))
        if args.ppl:
            row.ppl = peer_genai.heldout_ppl(directory, tokenizer, PPL_SEQ_LEN, args.threads[-1])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a HF ref")
    parser.add_argument("--group", default="1x256")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--artifact", default=None, help="use this masks artifact instead of random masks")
    add_protocol_options(parser)
    parser.add_argument("--rounds", type=int, default=3, help="processes per row and thread count, in turn")
    parser.add_argument("--ppl", action="store_true", help="held-out perplexity of each row (bundled text)")
    parser.add_argument("--record", default=None,
                        help="also write the rows as record NAME of bench/results/decode.json")
    args = parser.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    pattern = parse_pattern(args.group)
    model, tokenizer, model_label = load(args.model)
    masks = masks_for(model, pattern, args.sparsity, args.artifact)
    max_len = max(args.prefill, args.prompt + args.new_tokens) + 8
    with tempfile.TemporaryDirectory(prefix="gmc-bench-genai-") as scratch:
        rows = genai_rows(args, model, tokenizer, masks, pattern, max_len, Path(scratch))
        del model
        results = []
        for threads in args.threads:
            samples = {row.label: [] for row in rows}
            for _ in range(args.rounds):
                for row in rows:
                    samples[row.label].append(time_in_child(args, *row.child, threads))
            for row in rows:
                row.decode_s = statistics.median(s["decode_s"] for s in samples[row.label])
                row.prefill_s = statistics.median(s["prefill_s"] for s in samples[row.label])
            torch.set_num_threads(threads)
            results += _results(rows, copy_roofline(), model_label, threads, "float32")
    print(render(results, args))
    if args.record:
        write_record(results, args, command)


if __name__ == "__main__":
    main()
