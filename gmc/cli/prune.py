"""``gmc prune``: choose group masks for a model and write a masks artifact."""
from __future__ import annotations

import contextlib
import json
import sys

import click

from gmc.cli.options import build, options
from gmc.errors import GmcError
from gmc.graph.targets import projection_rank
from gmc.masks.distributed import env_rank, launched_by_torchrun
from gmc.masks.learn import RECIPES, LearnConfig
from gmc.masks.prune import PruneConfig, prune
from gmc.masks.prune_distributed import prune_distributed
from gmc.masks.sources import LEARNED_METHODS


@click.command("prune")
@click.argument("model")
@options(PruneConfig, skip=("model",), required=("output",))
@options(LearnConfig)
@click.option("--recipe", type=click.Choice(sorted(RECIPES)), default=None,
              help="A named set of learning defaults; 'paper' = the paper's (penalty budget, lambda 16, "
                   "lr 1e-3, logit offset 3, cold start, 40k steps). Explicit options win.")
@click.option("--quiet", is_flag=True, help="No progress bars or summary table.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object (no bars or table).")
def prune_command(model, recipe, quiet, as_json, **values):
    """Prune MODEL (hub id, HF directory, .gguf file, or smollm2-135m) to group sparsity.

    \b
    Examples:
      gmc prune smollm2-135m --sparsity 0.5 --group 1x64 --calib bundled --steps 300 --seq-len 256 -o runs/gm
      gmc prune smollm2-135m --method wanda --group 1x64 --calib bundled -o runs/wanda
      gmc prune path/to/hf --method magnitude --group 32x32 --allocation global -o runs/mag --save-dense runs/mag/hf
      torchrun --nproc-per-node 8 -m gmc prune meta-llama/Llama-2-13b-hf --batch-size 8 --device cuda -o runs/13b
    """
    with _rank_zero_reports():
        learn = build(LearnConfig, _with_recipe(recipe, values), progress=not (quiet or as_json))
        config = build(PruneConfig, values, model=model, learn=learn)
        artifact = prune_distributed(config) if launched_by_torchrun() else prune(config)
    if artifact is None:  # a torchrun rank other than 0: rank 0 reports
        return
    if as_json:
        keys = ("model", "method", "group", "allocation", "target_sparsity", "global_sparsity", "layer_sparsity")
        click.echo(json.dumps({"output": config.output, **{k: artifact.manifest.get(k) for k in keys}}))
        return
    if not quiet:
        print_summary(artifact.manifest)
    click.echo(f"wrote {config.output} (global sparsity {artifact.manifest['global_sparsity']:.4f})")


def _with_recipe(recipe, values: dict) -> dict:
    """``values`` with the recipe's settings where the user did not pass the option."""
    if recipe is None:
        return values
    if values["method"] not in LEARNED_METHODS:
        raise GmcError(f"--recipe {recipe} sets learning options: it applies to --method "
                       f"{' or '.join(LEARNED_METHODS)}, not {values['method']}")
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
