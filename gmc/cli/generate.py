"""``gmc generate``: text from a model, masks artifact or lowered directory, with a speed line."""
from __future__ import annotations

import click

from gmc.cli.options import build, options
from gmc.runtime.generate import GenerateConfig, SampleConfig, run_generate


@click.command()
@click.argument("ref")
@options(GenerateConfig, skip=("ref",))
@options(SampleConfig)
def generate(ref, **values):
    """Continue --prompt with REF: a model (smollm2-135m, a HF id or directory), a masks artifact (its masks
    folded into the base model) or a lowered directory; prints the text, then one line of prefill/decode speed."""
    import torch

    config = build(GenerateConfig, values, ref=ref, sample=build(SampleConfig, values))
    result = run_generate(config)
    click.echo(result.text)
    click.echo(f"{result.how}, {torch.get_num_threads()} thread(s): {result.generation.summary()}", err=True)
