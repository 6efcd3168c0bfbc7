"""``gmc prune``: choose group masks for a model and write a masks artifact."""
from __future__ import annotations

import contextlib
import sys

import click

from gmc.config import default_of
from gmc.errors import GmcError
from gmc.graph.targets import projection_rank
from gmc.inputs.model import DTYPES
from gmc.masks.budget import BUDGETS
from gmc.masks.distributed import env_rank, launched_by_torchrun
from gmc.masks.harness import PRECISIONS
from gmc.masks.heuristics import ALLOCATIONS
from gmc.masks.hypernet import HEADS
from gmc.masks.learn import COMPILE_CHOICES, COMPILE_MIN_STEPS, LEARNED_ALLOCATIONS, RECIPES, LearnConfig
from gmc.masks.prior import INITS
from gmc.masks.prune import METHODS, PruneConfig, prune
from gmc.masks.prune_distributed import prune_distributed


def default(name: str):
    return default_of(PruneConfig, name)


def _learn_default(name: str):
    return default_of(LearnConfig, name)


@click.command("prune")
@click.argument("model")
@click.option("-o", "--output", required=True, help="Output artifact directory (masks + manifest).")
@click.option("--method", type=click.Choice(METHODS), default=default("method"), show_default=True,
              help="groupmask = learned (hypernetwork); direct = learned free logits; "
                   "magnitude / wanda = heuristic scores; sparsegpt = OBS with weight updates.")
@click.option("--group", default=default("group"), show_default=True,
              help="Group shape GOUTxGIN (1x256, 1x64, 32x32, ...) or N:M (2:4) for heuristics.")
@click.option("--sparsity", type=float, default=default("sparsity"), show_default=True,
              help="Target fraction of target-linear parameters to prune, in (0, 1).")
@click.option("--allocation", type=click.Choice(sorted(set(LEARNED_ALLOCATIONS + ALLOCATIONS))),
              default=None, help="Learned: adaptive (default) | uniform. Heuristic: uniform (default) | global | owl.")
@click.option("--calib", default=default("calib"), show_default=True,
              help="Calibration text: wikitext2, wikitext103, alpaca, c4, bundled, a local .txt/.jsonl, or self.")
@click.option("--nsamples", type=int, default=None,
              help="Calibration blocks [default: all for learned methods, 128 for heuristics].")
@click.option("--seq-len", type=int, default=default("seq_len"), show_default=True, help="Tokens per calibration block.")
@click.option("--seed", type=int, default=default("seed"), show_default=True)
@click.option("--include", default=None, help="Regex of target module names [default: q,k,v,o,gate,up,down projections].")
@click.option("--ignore", default=None, help="Regex of module names to leave dense.")
@click.option("--dtype", type=click.Choice([*DTYPES, "auto"]), default=default("dtype"), show_default=True,
              help="auto: bfloat16 on CUDA, float32 on CPU.")
@click.option("--device", default=default("device"), show_default=True, help="auto: cuda when available, else cpu.")
@click.option("--save-dense", default=None, help="Also write an HF checkpoint with the masks folded in (zeros).")
@click.option("--steps", type=int, default=_learn_default("steps"), show_default=True, help="Learned: training steps.")
@click.option("--batch-size", type=int, default=_learn_default("batch_size"), show_default=True, help="Learned: sequences per step (global).")
@click.option("--lr", type=float, default=_learn_default("lr"), show_default=True)
@click.option("--budget", type=click.Choice(BUDGETS), default=_learn_default("budget"), show_default=True,
              help="topk: the selectors hold a scheduled budget exactly every step (lands at --ramp); "
                   "penalty: the paper's lambda * |log(r/r_t)| term.")
@click.option("--ramp", type=float, default=_learn_default("ramp"), show_default=True,
              help="topk: fraction of --steps over which the sparsity ramps (cubic) to the target.")
@click.option("--init", "init", type=click.Choice(INITS), default=_learn_default("init"), show_default=True,
              help="Mask prior: start the learned logits from this one-shot method's group ranking.")
@click.option("--recipe", type=click.Choice(sorted(RECIPES)), default=None,
              help="A named set of learning defaults; 'paper' = the paper's (penalty budget, lambda 16, "
                   "lr 1e-3, cold start, 40k steps). Explicit options win.")
@click.option("--recover-steps", type=int, default=default("recover_steps"), show_default=True,
              help="After the masks: tune the kept weights by distillation for this many steps (gmc recover).")
@click.option("--recover-lr", type=float, default=default("recover_lr"), show_default=True)
@click.option("--lambda", "lam", type=float, default=_learn_default("lam"), show_default=True,
              help="Budget regulariser weight (--budget penalty).")
@click.option("--temperature", type=float, default=_learn_default("temperature"), show_default=True)
@click.option("--noise/--no-noise", default=_learn_default("noise"), show_default=True,
              help="Gumbel noise in training (the export is always noise-free).")
@click.option("--head", type=click.Choice(HEADS), default=_learn_default("head"), show_default=True,
              help="Hypernetwork head: full (paper, 128 params/group) or lowrank.")
@click.option("--rank", type=int, default=_learn_default("rank"), show_default=True, help="Rank of the lowrank head.")
@click.option("--checkpoint-every", type=int, default=_learn_default("checkpoint_every"), show_default=True)
@click.option("--checkpoint-dir", default=None, help="Where checkpoints go [default: OUTPUT.ckpt].")
@click.option("--resume", is_flag=True, help="Continue the interrupted run from its checkpoint.")
@click.option("--optim-8bit", is_flag=True, help="bitsandbytes 8-bit AdamW (CUDA only).")
@click.option("--learn-weights", is_flag=True,
              help="Learned: train the kept weights with the masks (a delta per target, --weight-lr).")
@click.option("--weight-lr", type=float, default=_learn_default("weight_lr"), show_default=True,
              help="Learned with --learn-weights: learning rate of the weight deltas.")
@click.option("--teacher-cache/--no-teacher-cache", default=_learn_default("teacher_cache"), show_default=True,
              help="Learned: keep the dense model's final hidden states per calibration block and rerun only the "
                   "output head (memory: blocks x seq-len x hidden values).")
@click.option("--precision", type=click.Choice(PRECISIONS), default=_learn_default("precision"), show_default=True,
              help="Learned: the GEMMs' precision. auto: bf16 on CUDA, fp32 on CPU (bf16 there is faster on CPUs "
                   "with AVX512-BF16 or AMX). Weights, optimizer states and the loss stay fp32.")
@click.option("--compile-step", type=click.Choice(COMPILE_CHOICES), default=_learn_default("compile_step"),
              show_default=True,
              help=f"Learned, single process: compile the student's forward and backward with torch.compile "
                   f"(the first step compiles: about 2 minutes on 2 cores). auto: on for runs of "
                   f"{COMPILE_MIN_STEPS}+ steps.")
@click.option("--grad-checkpointing", is_flag=True,
              help="torchrun: recompute each decoder layer in backward (activation memory of one layer).")
@click.option("--fsdp-offload", is_flag=True, help="torchrun on CUDA: keep the frozen weight shards in host memory.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing masks artifact (-o) / dense checkpoint (--save-dense) that gmc wrote.")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run the model repository's own Python code.")
@click.option("--quiet", is_flag=True, help="No progress bars or summary table.")
def prune_command(model, output, method, group, sparsity, allocation, calib, nsamples, seq_len, seed,
                  include, ignore, dtype, device, save_dense, steps, batch_size, lr, lam, temperature,
                  noise, head, rank, checkpoint_every, checkpoint_dir, resume, optim_8bit, teacher_cache, learn_weights,
                  weight_lr, precision, compile_step, grad_checkpointing, fsdp_offload, budget, ramp, init, recipe,
                  recover_steps, recover_lr, overwrite, trust_remote_code, quiet):
    """Prune MODEL (hub id, HF directory, .gguf file, or smollm2-135m) to group sparsity.

    \b
    Examples:
      gmc prune smollm2-135m --sparsity 0.5 --group 1x64 --calib bundled --steps 300 --seq-len 256 -o runs/gm
      gmc prune smollm2-135m --method wanda --group 1x64 --calib bundled -o runs/wanda
      gmc prune path/to/hf --method magnitude --group 32x32 --allocation global -o runs/mag --save-dense runs/mag/hf
      torchrun --nproc-per-node 8 -m gmc prune meta-llama/Llama-2-13b-hf --batch-size 8 --device cuda -o runs/13b
    """
    with _rank_zero_reports():
        chosen = _with_recipe(recipe, dict(steps=steps, lr=lr, lam=lam, budget=budget, ramp=ramp, init=init))
        learn = LearnConfig(**chosen, batch_size=batch_size, temperature=temperature,
                            noise=noise, head=head, rank=rank, checkpoint_every=checkpoint_every,
                            checkpoint_dir=checkpoint_dir, resume=resume, optim_8bit=optim_8bit,
                            teacher_cache=teacher_cache, learn_weights=learn_weights, weight_lr=weight_lr,
                            precision=precision, compile_step=compile_step,
                            grad_checkpointing=grad_checkpointing, fsdp_offload=fsdp_offload, progress=not quiet)
        config = PruneConfig(model=model, output=output, method=method, group=group, sparsity=sparsity,
                             allocation=allocation, calib=calib, nsamples=nsamples, seq_len=seq_len,
                             seed=seed, include=include, ignore=ignore, dtype=dtype, device=device,
                             save_dense=save_dense, recover_steps=recover_steps, recover_lr=recover_lr, overwrite=overwrite, trust_remote_code=trust_remote_code,
                             learn=learn)
        artifact = prune_distributed(config) if launched_by_torchrun() else prune(config)
    if artifact is None:  # a torchrun rank other than 0: rank 0 reports
        return
    if not quiet:
        print_summary(artifact.manifest)
    click.echo(f"wrote {output} (global sparsity {artifact.manifest['global_sparsity']:.4f})")


def _with_recipe(recipe, values: dict) -> dict:
    """``values`` with the recipe's settings where the user did not pass the option."""
    if recipe is None:
        return values
    context = click.get_current_context()
    return {name: value if context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
            else RECIPES[recipe].get(name, value) for name, value in values.items()}


@contextlib.contextmanager
def _rank_zero_reports():
    """Under torchrun, ranks other than 0 leave a GmcError to rank 0, which prints it once and exits
    non-zero (the distributed pipeline makes every rank raise the same error). They exit 0: a
    failed worker makes torchrun stop the others at once, which could kill rank 0 before it
    printed the message or wrote its Ctrl-C checkpoint."""
    try:
        yield
    except GmcError:
        if launched_by_torchrun() and env_rank() != 0:
            sys.exit(0)
        raise


def print_summary(manifest: dict) -> None:
    """Per-layer sparsity table: decoder layers as rows, projection types as columns."""
    from rich.console import Console
    from rich.table import Table

    rows: dict[str, dict[str, float]] = {}
    for name, value in manifest["layer_sparsity"].items():
        parts = name.split(".")
        layer = next((p for p in parts if p.isdigit()), "-")
        rows.setdefault(layer, {})[parts[-1]] = value
    columns = sorted({c for r in rows.values() for c in r}, key=projection_rank)
    table = Table(title=f"sparsity by layer ({manifest['method']}, {manifest['group']}, "
                        f"{manifest['allocation']}; global {manifest['global_sparsity']:.3f})")
    table.add_column("layer", justify="right")
    for column in columns:
        table.add_column(column, justify="right")
    for layer in sorted(rows, key=lambda x: int(x) if x.isdigit() else -1):
        table.add_row(layer, *(f"{rows[layer][c]:.2f}" if c in rows[layer] else "" for c in columns))
    Console(stderr=True).print(table)
