"""``gmc reconstruct``: SparseGPT-style update of the kept weights for an artifact's masks."""
from __future__ import annotations

import click

from gmc.cli.options import build, options
from gmc.masks.reconstruct import ReconstructConfig, reconstruct_artifact


@click.command("reconstruct")
@click.argument("artifact")
@options(ReconstructConfig, skip=("artifact",), required=("output", "calib"))
@click.option("--quiet", is_flag=True, help="No progress bar.")
def reconstruct(artifact, quiet, **values):
    """Update the kept weights of ARTIFACT's masks to reconstruct the dense layer outputs.

    \b
    Examples:
      gmc reconstruct runs/groupmask --calib bundled --nsamples 64 --seq-len 256 -o runs/groupmask-rec
      gmc eval smollm2-135m runs/groupmask-rec --ppl bundled-heldout
    """
    config = build(ReconstructConfig, values, artifact=artifact, progress=not quiet)
    result = reconstruct_artifact(config)
    click.echo(f"wrote {config.output} ({len(result.weights)} updated weights, "
               f"global sparsity {result.manifest['global_sparsity']:.4f})")
