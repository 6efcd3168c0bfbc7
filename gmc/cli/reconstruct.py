"""``gmc reconstruct``: SparseGPT-style update of the kept weights for an artifact's masks."""
from __future__ import annotations

import click

from gmc.config import default_of
from gmc.inputs.model import DTYPES
from gmc.masks.reconstruct import ReconstructConfig, reconstruct_artifact
from gmc.masks.sparsegpt import TARGETS


@click.command("reconstruct")
@click.argument("artifact")
@click.option("-o", "--output", required=True, help="Output artifact directory (same masks + updated weights).")
@click.option("--calib", required=True,
              help="Calibration text: wikitext2, wikitext103, alpaca, c4, bundled, or a local .txt/.jsonl.")
@click.option("--nsamples", type=int, default=default_of(ReconstructConfig, "nsamples"), show_default=True, help="Calibration blocks.")
@click.option("--seq-len", type=int, default=default_of(ReconstructConfig, "seq_len"), show_default=True, help="Tokens per calibration block.")
@click.option("--seed", type=int, default=default_of(ReconstructConfig, "seed"), show_default=True)
@click.option("--model", default=None, help="Dense base model [default: the one named in the artifact's manifest].")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=default_of(ReconstructConfig, "dtype"), show_default=True)
@click.option("--device", default=default_of(ReconstructConfig, "device"), show_default=True)
@click.option("--damp", type=float, default=default_of(ReconstructConfig, "damp"), show_default=True,
              help="Hessian dampening, fraction of its mean diagonal.")
@click.option("--refine-steps", type=int, default=default_of(ReconstructConfig, "refine_steps"), show_default=True,
              help="Conjugate-gradient steps after the OBS sweep (towards the exact least-squares fit).")
@click.option("--target", type=click.Choice(TARGETS), default=default_of(ReconstructConfig, "target"), show_default=True,
              help="pruned: fit each layer to the dense weights on the pruned model's inputs (SparseGPT); "
                   "dense: fit it to the dense model's own outputs (compensates earlier layers' errors).")
@click.option("--overwrite", is_flag=True, help="Replace an existing masks artifact that gmc wrote at -o.")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run the model repository's own Python code.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def reconstruct(artifact, output, calib, nsamples, seq_len, seed, model, dtype, device, damp, refine_steps, target, overwrite,
                trust_remote_code, quiet):
    """Update the kept weights of ARTIFACT's masks to reconstruct the dense layer outputs.

    \b
    Examples:
      gmc reconstruct runs/groupmask --calib bundled --nsamples 64 --seq-len 256 -o runs/groupmask-rec
      gmc eval smollm2-135m runs/groupmask-rec --ppl bundled-heldout
    """
    config = ReconstructConfig(artifact=artifact, output=output, calib=calib, nsamples=nsamples,
                               seq_len=seq_len, seed=seed, model=model, dtype=dtype, device=device,
                               damp=damp, refine_steps=refine_steps, target=target, progress=not quiet, overwrite=overwrite,
                               trust_remote_code=trust_remote_code)
    result = reconstruct_artifact(config)
    click.echo(f"wrote {output} ({len(result.weights)} updated weights, "
               f"global sparsity {result.manifest['global_sparsity']:.4f})")
