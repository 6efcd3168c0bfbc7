"""``gmc info``: what a masks artifact, lowered directory, ONNX file or HF checkpoint holds."""
from __future__ import annotations

import json

import click

from gmc.cli.options import build, options
from gmc.runtime.info import InfoConfig, describe, render


@click.command("info")
@click.argument("path", metavar="PATH")
@options(InfoConfig, skip=("path",))
def info(path, **values):
    """Describe PATH per layer and in total: a masks artifact, a lowered directory, an ONNX model directory,
    or a HF checkpoint (its zeros, and how many of them fill whole --group groups).

    \b
      gmc info runs/gm
      gmc info runs/gm-packed --json
      gmc info pruned-elsewhere/ --group 1x64
    """
    config = build(InfoConfig, values, path=path)
    described = describe(config.path, config.group)
    if config.as_json:
        click.echo(json.dumps(described, indent=2))
        return
    from rich.console import Console

    render(described, Console(width=120))
