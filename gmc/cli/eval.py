"""``gmc eval``: perplexity and lm-eval zero-shot for models, masks artifacts and lowered models."""
from __future__ import annotations

import click

from gmc.cli.options import build, options
from gmc.errors import GmcError
from gmc.runtime.evaluate import EvalConfig, PerplexityConfig, ZeroShotConfig, evaluate_refs
from gmc.runtime.results import check_results_path, comparison_rows, protocol_lines, write_results


@click.command("eval")
@click.argument("refs", nargs=-1, required=True, metavar="REF [REF...]")
@options(PerplexityConfig)
@options(ZeroShotConfig)
@options(EvalConfig)
def eval_(refs, **values):
    """Evaluate each REF: a model (smollm2-135m, hub id, .gguf, HF dir), a masks artifact or a
    lowered model. With several REFs the first is the baseline of the deltas.

    \b
      gmc eval smollm2-135m runs/wanda runs/gm --ppl wikitext2 --seq-len 2048
      gmc eval runs/gm --tasks paper
      gmc eval runs/gm --ppl text.txt --tasks mytask --include-path tasks/ --limit 200
    """
    if values["tasks"] is None and (values["limit"] is not None or values["include_path"] is not None):
        raise GmcError("--limit and --include-path apply to zero-shot tasks: add --tasks")
    if values["source"] is None and values["tasks"] is None:
        values["source"] = PerplexityConfig.source
    config = build(EvalConfig, values,
                   perplexity=None if values["source"] is None else build(PerplexityConfig, values),
                   zero_shot=None if values["tasks"] is None else build(ZeroShotConfig, values))
    if config.output:  # before any model loads: an evaluation must not fail at its last write
        check_results_path(config.output, config.overwrite, inputs=[*refs, values["source"], values["include_path"],
                                                                     config.model])
    entries = evaluate_refs(list(refs), config)
    _print_table(entries)
    if config.output:
        path = write_results(config.output, entries, config.overwrite)
        click.echo(f"wrote {path} and {path.with_suffix('.md')}")


def _print_table(entries: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    header, rows = comparison_rows(entries)
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    Console(width=max(100, 16 * len(header))).print(table)
    for line in protocol_lines(entries):
        click.echo(line)
