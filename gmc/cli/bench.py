"""``gmc bench``: prompt-processing and token-generation speed of refs, as a llama-bench table, JSON or CSV."""
from __future__ import annotations

import click

from gmc.cli.options import build, options
from gmc.runtime.bench import BenchConfig, render, run_bench, write_bench


@click.command("bench")
@click.argument("refs", nargs=-1, required=True, metavar="REF [REF...]")
@options(BenchConfig, skip=("refs",))
def bench(refs, **values):
    """Time pp (one prefill of -p tokens) and tg (-n one-token decode steps) of each REF on each thread
    count: a model (smollm2-135m, hub id, HF dir), a masks artifact, a lowered directory (its compiled
    programs when it has them) or an ONNX file; mean ± std of -r repetitions interleaved across REFs.

    \b
      gmc bench smollm2-135m runs/gm runs/gm-packed -t 1,2
      gmc bench runs/gm-int4 runs/gm-onnx -p 128 -n 32 --format json -o bench.json
    """
    config = build(BenchConfig, values, refs=refs)
    text = render(run_bench(config), config.format)
    if config.output:
        click.echo(f"wrote {write_bench(config.output, text, config.overwrite)}", err=True)
    else:
        click.echo(text, nl=False)
