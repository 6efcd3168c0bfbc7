"""``gmc recover``: tune an artifact's kept weights by self-distillation from the dense model."""
from __future__ import annotations

import click

from gmc.cli.options import build, options
from gmc.masks.recover import RecoverArtifactConfig, RecoverConfig, recover_artifact


@click.command("recover")
@click.argument("artifact")
@options(RecoverArtifactConfig, skip=("artifact",), required=("output",))
@options(RecoverConfig)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def recover(artifact, quiet, **values):
    """Tune the kept weights of ARTIFACT's masks by distillation from the dense model.

    Pruned weights stay exactly zero; the masks do not change. Starts from the artifact's
    weights when it has some (e.g. SparseGPT's), else from the dense ones.

    \b
    Examples:
      gmc recover runs/gm --calib bundled --steps 200 --seq-len 256 -o runs/gm-rec
      gmc eval smollm2-135m runs/gm-rec --ppl bundled-heldout
    """
    settings = build(RecoverConfig, values, progress=not quiet)
    config = build(RecoverArtifactConfig, values, artifact=artifact, recover=settings)
    result = recover_artifact(config)
    click.echo(f"wrote {config.output} ({len(result.weights)} tuned weights, "
               f"global sparsity {result.manifest['global_sparsity']:.4f})")
