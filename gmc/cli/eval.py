"""``gmc eval``: perplexity and lm-eval zero-shot for models, masks artifacts and lowered models."""
from __future__ import annotations

import click

from gmc.errors import GmcError
from gmc.inputs.model import DTYPES
from gmc.runtime.evaluate import PAPER_TASKS, EvalConfig, PerplexityConfig, ZeroShotConfig, evaluate_refs
from gmc.runtime.results import check_results_path, comparison_rows, protocol_lines, write_results


def _parse_limit(text: str | None):
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise GmcError(f"bad --limit {text!r}: a positive count of documents or a fraction in (0, 1)") from None


def _parse_tasks(text: str) -> tuple[str, ...]:
    if text.strip() == "paper":
        return PAPER_TASKS
    return tuple(task.strip() for task in text.split(","))


@click.command("eval")
@click.argument("refs", nargs=-1, required=True, metavar="REF [REF...]")
@click.option("--ppl", "ppl_source", metavar="SOURCE",
              help=f"perplexity text: wikitext2, wikitext103, c4, bundled, bundled-heldout, a .txt/.jsonl "
                   f"[default: {PerplexityConfig.source} unless only --tasks is given]")
@click.option("--split", default=PerplexityConfig.split, show_default=True, help="split of a hub dataset")
@click.option("--seq-len", type=int, default=PerplexityConfig.seq_len, show_default=True,
              help="tokens per perplexity window")
@click.option("--stride", type=int, default=PerplexityConfig.stride,
              help="slide windows by this many tokens, scoring only new ones [default: non-overlapping]")
@click.option("--tasks", "tasks_text", metavar="A,B",
              help=f"lm-eval tasks, comma-separated; 'paper' = the paper's six ({', '.join(PAPER_TASKS)})")
@click.option("--limit", "limit_text", metavar="N",
              help="documents per task (an integer) or a fraction < 1; for quick checks, not for reporting")
@click.option("--batch-size", type=int, default=PerplexityConfig.batch_size, show_default=True,
              help="perplexity windows / lm-eval requests per forward pass")
@click.option("--include-path", type=click.Path(), help="directory of local lm-eval task YAMLs")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=EvalConfig.dtype, show_default=True)
@click.option("--device", default=EvalConfig.device, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="results JSON (a markdown table is written next to it, same name .md)")
@click.option("--overwrite", is_flag=True, help="Replace existing results (JSON + .md) that gmc wrote at -o.")
@click.option("--model", default=None,
              help="Base model of every masks artifact among REFs [default: the one its manifest names].")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run the model repository's own Python code.")
def eval_(refs, ppl_source, split, seq_len, stride, tasks_text, limit_text, batch_size, include_path,
          dtype, device, output, overwrite, model, trust_remote_code):
    """Evaluate each REF: a model (smollm2-135m, hub id, .gguf, HF dir), a masks artifact or a
    lowered model. With several REFs the first is the baseline of the deltas.

    \b
      gmc eval smollm2-135m runs/wanda runs/gm --ppl wikitext2 --seq-len 2048
      gmc eval runs/gm --tasks paper
      gmc eval runs/gm --ppl text.txt --tasks mytask --include-path tasks/ --limit 200
    """
    if tasks_text is None and (limit_text is not None or include_path is not None):
        raise GmcError("--limit and --include-path apply to zero-shot tasks: add --tasks")
    if ppl_source is None and tasks_text is None:
        ppl_source = PerplexityConfig.source
    config = EvalConfig(
        perplexity=None if ppl_source is None else PerplexityConfig(ppl_source, split, seq_len, stride, batch_size),
        zero_shot=None if tasks_text is None else ZeroShotConfig(
            _parse_tasks(tasks_text), _parse_limit(limit_text), batch_size, include_path),
        dtype=dtype,
        device=device,
        model=model,
        trust_remote_code=trust_remote_code,
    )
    if output:  # before any model loads: an evaluation must not fail at its last write
        check_results_path(output, overwrite, inputs=[*refs, ppl_source, include_path, model])
    entries = evaluate_refs(list(refs), config)
    _print_table(entries)
    if output:
        path = write_results(output, entries, overwrite)
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
