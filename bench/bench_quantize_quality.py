"""Held-out perplexity of the bundled SmolLM2-135M with its weights stored as gmc stores them:
the 210 target linears and the output head each as fp32, int8 or int4 (``gmc.kernels.quantize.quantize``
of every group kept, dequantized back: the numbers the kernel multiplies, x itself not quantized).

    python bench/bench_quantize_quality.py --record smollm2

Why the output head stays int8 under ``--quantize int4`` (``gmc.graph.pipeline.packed_head``).
"""
from __future__ import annotations

import argparse
import copy
import shlex
import sys
import time

import torch

from gmc.graph.targets import eager_targets
from gmc.inputs.model import load_model
from gmc.kernels.packed import pack_dense
from gmc.kernels.quantize import quantize
from gmc.runtime.evaluate import perplexity

CONFIGS = [("none", "none"), ("int8", "int8"), ("int4", "int8"), ("int4", "int4")]  # (targets, head)
SEQ_LEN = 512


def stored(weight: torch.Tensor, how: str) -> torch.Tensor:
    """``weight`` as the kernel reads it when its values are stored as ``how``."""
    return weight if how == "none" else quantize(pack_dense(weight, "1x256"), how).unpack()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", default=None,
                        help="also write the rows as record NAME of bench/results/quantize.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    loaded = load_model("smollm2-135m")
    rows = []
    for targets, head in CONFIGS:
        start = time.perf_counter()
        model = copy.deepcopy(loaded.model)
        with torch.no_grad():
            for target in eager_targets(model):
                linear = model.get_submodule(target.name)
                linear.weight.data = stored(linear.weight.data, targets)
            output = model.get_output_embeddings()  # tied to the input embedding: untie, the table stays fp32
            output.weight = torch.nn.Parameter(stored(output.weight.data.clone(), head), requires_grad=False)
        ppl = perplexity(model, loaded.tokenizer, "bundled-heldout", seq_len=SEQ_LEN, progress=False).perplexity
        rows.append({"targets": targets, "head": head, "ppl": ppl})
        print(f"targets {targets}, head {head}: {ppl:.2f} ({time.perf_counter() - start:.0f} s)", flush=True)
    base = rows[0]["ppl"]
    for row in rows:
        row["vs_fp32"] = 100 * (row["ppl"] / base - 1)
    if args.record:
        from host import host
        from records import save_record

        save_record("quantize", {
            "name": args.record, "title": "Bundled SmolLM2-135M, dense, weights stored as gmc stores them",
            "bench": "bench/bench_quantize_quality.py", "command": command,
            "host": {**host(), "threads": args.threads},
            "columns": [{"key": "targets", "title": "210 target linears"}, {"key": "head", "title": "output head"},
                        {"key": "ppl", "title": "held-out ppl", "format": "{:.2f}"},
                        {"key": "vs_fp32", "title": "vs fp32", "format": "{:+.2f}%"}],
            "rows": rows,
            "notes": [f"Perplexity: bundled-heldout, {SEQ_LEN}-token windows; none: fp32. x is not quantized (the "
                      "int8 and int4 products quantize it to int8 per 32 numbers: bench_decode.py --int8 --int4 "
                      "--ppl --decode-ppl measures that). "
                      "The bundled weights are llama.cpp Q4_1 (32 weights a scale and offset, the rule of "
                      "quantize_int4) dequantized, so int4 targets reproduce them; its token embedding, which "
                      "is the output head, is stored at 8 bits."],
        })


if __name__ == "__main__":
    main()
