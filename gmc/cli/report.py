"""``gmc report``: where the sparsity budget of a masks artifact went (docs/design.md section 7)."""
from __future__ import annotations

import click

from gmc.cli.options import build, options
from gmc.runtime.report import (
    BLOCKS_PNG,
    RATES_PNG,
    ReportConfig,
    key_numbers,
    summary_rows,
    write_report,
)


@click.command("report")
@click.argument("artifact", metavar="ARTIFACT")
@options(ReportConfig, skip=("artifact",))
def report(artifact, **values):
    """Analyse the per-layer sparsity of a masks ARTIFACT: plots, markdown, JSON and a table.

    \b
      gmc report runs/gm
      gmc report runs/gm -o runs/gm/report
    """
    config = build(ReportConfig, values, artifact=artifact)
    result = write_report(config)
    _print_summary(result)
    click.echo(f"wrote {config.output}/{{report.json,report.md,{RATES_PNG},{BLOCKS_PNG}}}")


def _print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    header, rows = summary_rows(result)
    table = Table(*header, title=f"preserved parameters: {result['artifact']}")
    for row in rows:
        table.add_row(*row)
    console = Console(width=110)
    console.print(table)
    for label, value in key_numbers(result):
        console.print(f"{label}: [bold]{value}[/bold]", highlight=False)
