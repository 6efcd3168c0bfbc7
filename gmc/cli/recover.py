"""``gmc recover``: tune an artifact's kept weights by self-distillation from the dense model."""
from __future__ import annotations

import click

from gmc.config import default_of
from gmc.inputs.model import DTYPES
from gmc.masks.recover import RecoverArtifactConfig, RecoverConfig, recover_artifact


def _art(name: str):
    return default_of(RecoverArtifactConfig, name)


def _rec(name: str):
    return default_of(RecoverConfig, name)


@click.command("recover")
@click.argument("artifact")
@click.option("-o", "--output", required=True, help="Output artifact directory (same masks + tuned weights).")
@click.option("--calib", default=_art("calib"), show_default=True,
              help="Calibration text: wikitext2, wikitext103, alpaca, c4, bundled, or a local .txt/.jsonl.")
@click.option("--nsamples", type=int, default=None, help="Calibration blocks [default: all].")
@click.option("--seq-len", type=int, default=_art("seq_len"), show_default=True,
              help="Tokens per calibration block.")
@click.option("--steps", type=int, default=_rec("steps"), show_default=True)
@click.option("--lr", type=float, default=_rec("lr"), show_default=True)
@click.option("--weight-decay", type=float, default=_rec("weight_decay"), show_default=True)
@click.option("--batch-size", type=int, default=_rec("batch_size"), show_default=True)
@click.option("--seed", type=int, default=_art("seed"), show_default=True)
@click.option("--model", default=None, help="Dense base model [default: the one named in the artifact's manifest].")
@click.option("--dtype", type=click.Choice([*DTYPES, "auto"]), default=_art("dtype"), show_default=True,
              help="auto: bfloat16 on CUDA, float32 on CPU.")
@click.option("--device", default=_art("device"), show_default=True, help="auto: cuda when available, else cpu.")
@click.option("--checkpoint-every", type=int, default=_rec("checkpoint_every"), show_default=True)
@click.option("--checkpoint-dir", default=None, help="Where checkpoints go [default: OUTPUT.recover-ckpt].")
@click.option("--resume", is_flag=True, help="Continue the interrupted recovery from its checkpoint.")
@click.option("--optim-8bit", is_flag=True, help="bitsandbytes 8-bit AdamW (CUDA only).")
@click.option("--grad-checkpointing", is_flag=True, help="Recompute decoder layers in backward (less memory).")
@click.option("--overwrite", is_flag=True, help="Replace an existing masks artifact that gmc wrote at -o.")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run the model repository's own Python code.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def recover(artifact, output, calib, nsamples, seq_len, steps, lr, weight_decay, batch_size, seed, model, dtype,
            device, checkpoint_every, checkpoint_dir, resume, optim_8bit, grad_checkpointing, overwrite,
            trust_remote_code, quiet):
    """Tune the kept weights of ARTIFACT's masks by distillation from the dense model.

    Pruned weights stay exactly zero; the masks do not change. Starts from the artifact's
    weights when it has some (e.g. SparseGPT's), else from the dense ones.

    \b
    Examples:
      gmc recover runs/gm --calib bundled --steps 200 --seq-len 256 -o runs/gm-rec
      gmc eval smollm2-135m runs/gm-rec --ppl bundled-heldout
    """
    settings = RecoverConfig(steps=steps, lr=lr, weight_decay=weight_decay, batch_size=batch_size,
                             checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir, resume=resume,
                             optim_8bit=optim_8bit, grad_checkpointing=grad_checkpointing, progress=not quiet)
    config = RecoverArtifactConfig(artifact=artifact, output=output, calib=calib, nsamples=nsamples, seq_len=seq_len,
                                   seed=seed, model=model, dtype=dtype, device=device, overwrite=overwrite,
                                   trust_remote_code=trust_remote_code, recover=settings)
    result = recover_artifact(config)
    click.echo(f"wrote {output} ({len(result.weights)} tuned weights, "
               f"global sparsity {result.manifest['global_sparsity']:.4f})")
