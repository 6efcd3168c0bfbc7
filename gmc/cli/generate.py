"""``gmc generate``: text from a model, masks artifact or lowered directory, streamed, with a speed line;
a chat in the tokenizer's template, one message or turn by turn (``-i``)."""
from __future__ import annotations

import json

import click

from gmc.cli.options import build, options
from gmc.errors import GmcError
from gmc.runtime.chat import write_stdout
from gmc.runtime.generate import GenerateConfig, SampleConfig, run_chat, run_generate


@click.command()
@click.argument("ref")
@options(GenerateConfig, skip=("ref",))
@options(SampleConfig)
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON summary (text, token ids, speeds, how it ran) at the end instead of streaming "
                   "the text and the speed line.")
def generate(ref, as_json, **values):
    """Continue --prompt with REF: a model (smollm2-135m, a HF id or directory), a masks artifact (its masks
    folded into the base model) or a lowered directory; streams the text, then one line of prefill/decode
    speed. A tokenizer with a chat template gets the prompt as a user's message and the reply alone is printed.

    \b
    Examples:
      gmc generate smollm2-135m --prompt "What is gravity?"    # a chat: the model has a chat template
      gmc generate smollm2-135m -i                              # a conversation in the terminal
      gmc generate runs/gm-packed --no-chat --prompt-file story.txt --temperature 0.8 --top-p 0.9
      echo "The hacker" | gmc generate runs/gm --no-chat --prompt - --json
    """
    import torch

    config = build(GenerateConfig, values, ref=ref, sample=build(SampleConfig, values))
    if config.interactive:
        if as_json:
            raise GmcError("--json summarises one generation, -i holds a conversation: give one of them")
        run_chat(config)
        return
    result = run_generate(config, None if as_json else write_stdout)
    if as_json:
        click.echo(json.dumps(result.record()))
        return
    click.echo(f"{result.how}, {torch.get_num_threads()} thread(s): {result.generation.summary()}", err=True)
