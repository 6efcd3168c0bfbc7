"""``gmc lower``: a masks artifact -> a packed group-sparse model, an ONNX file or a dense HF checkpoint."""
from __future__ import annotations

import click

from gmc.cli.options import build, options
from gmc.lower.stage import LowerConfig, lower_artifact


@click.command()
@click.argument("artifact", type=click.Path())
@options(LowerConfig, skip=("artifact",), required=("output",))
def lower(artifact, **values):
    """Lower the masks in ARTIFACT (from `gmc prune`, `recover`, `reconstruct`) for a backend and device.

    \b
    Examples:
      gmc lower runs/gm -o runs/gm-packed                       # packed, for this machine's device
      gmc lower runs/gm --quantize int4 --compile -o runs/gm-int4
      gmc lower runs/gm --device cuda --dtype bfloat16 -o runs/gm-cuda
      gmc lower runs/gm --backend onnx -o runs/gm.onnx
      gmc lower runs/gm --backend dense -o runs/gm-hf
    """
    config = build(LowerConfig, values, artifact=artifact)
    result = lower_artifact(config)
    if config.backend == "dense":
        click.echo(f"folded {artifact} -> {result.path} (HF checkpoint; pruned groups are zeros)")
        return
    ratio = result.packed_bytes / max(result.dense_bytes, 1)
    click.echo(f"lowered {artifact} -> {result.path} (backend {config.backend}, {config.device}; target weights "
               f"{result.packed_bytes / 2**20:.1f} MiB packed = {ratio:.3f}x dense"
               + (f"; compiled prefill/decode programs, {config.max_len} positions)" if config.compile else ")"))
