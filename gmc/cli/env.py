"""``gmc env``: versions, host and which kernel paths load, for bug reports and for reading a benchmark."""
from __future__ import annotations

import json

import click


@click.command("env")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
def env(as_json):
    """Print gmc's environment: package versions, Python, CPU model, ISA, cores, whether gmc's C++ CPU
    kernel loads, CUDA devices and Triton."""
    from gmc.runtime.host import environment, environment_lines

    found = environment()
    click.echo(json.dumps(found, indent=2) if as_json else "\n".join(environment_lines(found)))
