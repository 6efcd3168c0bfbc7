"""``gmc generate``: text from a model, masks artifact or lowered directory, with a speed line."""
from __future__ import annotations

import click

from gmc.config import default_of
from gmc.inputs.model import DTYPES
from gmc.runtime.generate import GenerateConfig, SampleConfig, run_generate


@click.command()
@click.argument("ref")
@click.option("--prompt", default=default_of(GenerateConfig, "prompt"), show_default=True, help="Text to continue.")
@click.option("--max-new-tokens", type=int, default=default_of(SampleConfig, "max_new_tokens"), show_default=True)
@click.option("--temperature", type=float, default=default_of(SampleConfig, "temperature"), show_default=True,
              help="0: greedy; > 0: sample from softmax(logits / temperature)")
@click.option("--top-k", type=int, default=None, help="Sample only among the k likeliest tokens.")
@click.option("--seed", type=int, default=default_of(SampleConfig, "seed"), show_default=True)
@click.option("--compile", "compile_", is_flag=True,
              help="CPU: export prefill/decode programs and compile them with AOTInductor first (a lowered directory "
                   "made with `gmc lower --compile` runs its own compiled programs without this flag). CUDA: record "
                   "the decode step as one CUDA graph and replay it per token.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=default_of(GenerateConfig, "dtype"), show_default=True)
@click.option("--device", default=default_of(GenerateConfig, "device"), show_default=True)
@click.option("--threads", type=int, default=None, help="CPU threads [default: torch's].")
@click.option("--model", default=None, help="Base model of a masks artifact [default: the one its manifest names].")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run the model repository's own Python code.")
def generate(ref, prompt, max_new_tokens, temperature, top_k, seed, compile_, dtype, device, threads, model,
             trust_remote_code):
    """Continue --prompt with REF: a model (smollm2-135m, a HF id or directory), a masks artifact (its masks
    folded into the base model) or a lowered directory; prints the text, then one line of prefill/decode speed."""
    import torch

    from gmc.config import check_at_least

    if threads is not None:
        check_at_least("--threads", threads, 1)
        torch.set_num_threads(threads)
    sample = SampleConfig(max_new_tokens, temperature, top_k, seed)
    result = run_generate(GenerateConfig(ref, prompt, sample, compile_, dtype, device, model, trust_remote_code))
    click.echo(result.text)
    click.echo(f"{result.how}, {torch.get_num_threads()} thread(s): {result.generation.summary()}", err=True)
