"""``gmc lower``: a masks artifact -> a packed group-sparse model, an ONNX file or a dense HF checkpoint."""
from __future__ import annotations

import dataclasses
import json

import click

from gmc.cli.options import build, options
from gmc.lower.stage import LowerConfig, lower_artifact


@click.command()
@click.argument("artifact", type=click.Path())
@options(LowerConfig, skip=("artifact",), required=("output",))
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def lower(artifact, quiet, as_json, **values):
    """Lower the masks in ARTIFACT (from `gmc prune`, `recover`, `reconstruct`) for a backend and device.

    \b
    Examples:
      gmc lower runs/gm -o runs/gm-packed                       # packed, for this machine's device
      gmc lower runs/gm --quantize int4 --compile -o runs/gm-int4
      gmc lower runs/gm --device cuda --dtype bfloat16 -o runs/gm-cuda
      gmc lower runs/gm --backend onnx --quantize int4 -o runs/gm-onnx    # onnxruntime-genai loads it
      gmc lower runs/gm --backend dense -o runs/gm-hf
    """
    config = build(LowerConfig, values, artifact=artifact, progress=not (quiet or as_json))
    result = lower_artifact(config)
    ratio = result.packed_bytes / max(result.dense_bytes, 1)
    if as_json:
        summary = {"artifact": artifact, **dataclasses.asdict(result), "path": str(result.path),
                   "backend": config.backend, "device": config.device, "dtype": config.dtype,
                   "quantize": config.quantize, "compiled": config.compile, "packed_to_dense": ratio}
        click.echo(json.dumps(summary))
        return
    if config.backend == "dense":
        click.echo(f"folded {artifact} -> {result.path} (HF checkpoint; pruned groups are zeros)")
        return
    click.echo(f"lowered {artifact} -> {result.path} (backend {config.backend}, {config.device}; target weights "
               f"{result.packed_bytes / 2**20:.1f} MiB packed = {ratio:.3f}x dense"
               + (f"; compiled prefill/decode programs, {config.max_len} positions)" if config.compile else ")"))
