"""``gmc lower``: a masks artifact -> packed group-sparse model (torch, triton), ONNX file or dense HF checkpoint."""
from __future__ import annotations

import click

from gmc.config import default_of
from gmc.inputs.model import DTYPES
from gmc.runtime.lower import BACKENDS, QUANTIZE, LowerConfig, lower_artifact


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--backend", type=click.Choice(BACKENDS), default=default_of(LowerConfig, "backend"), show_default=True,
              help="torch: packed directory + lowered program, CPU op; triton: the same for CUDA Triton kernels; onnx: .onnx file; dense: the masks folded into an HF checkpoint")
@click.option("--onnx-standard-ops", is_flag=True,
              help="with --backend onnx: standard ONNX ops instead of the gmc::GroupSparseLinear custom op")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=default_of(LowerConfig, "dtype"), show_default=True,
              help="dtype of the stored weights")
@click.option("-o", "--out", required=True, type=click.Path(), help="output directory (torch, triton, dense) or .onnx file")
@click.option("--overwrite", is_flag=True, help="Replace an existing output of the same kind that gmc wrote at -o.")
@click.option("--model", default=None, help="Dense base model [default: the one named in the artifact's manifest].")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run the model repository's own Python code.")
@click.option("--compile", "compile_", is_flag=True,
              help="torch: also export prefill and decode programs over a static KV cache and compile them "
                   "ahead of time (AOTInductor) into <out>/compiled; `gmc generate <out>` runs them (on CUDA, "
                   "`gmc generate --compile --device cuda` graphs the decode step instead)")
@click.option("--max-len", type=int, default=default_of(LowerConfig, "max_len"), show_default=True,
              help="with --compile: KV cache positions (prompt + generated tokens) of the compiled programs")
@click.option("--quantize", type=click.Choice(QUANTIZE), default=default_of(LowerConfig, "quantize"), show_default=True,
              help="int8: kept values weight-only int8, one scale per kept group column; int4: two 4-bit codes "
                   "a byte, an fp16 scale and offset per 32 weights of a column (the CPU and the CUDA op)")
def lower(artifact_dir, backend, onnx_standard_ops, dtype, out, overwrite, model, trust_remote_code, compile_,
          max_len, quantize):
    """Lower the masks in ARTIFACT_DIR (from `gmc prune`, `recover`, `reconstruct`) to a packed group-sparse
    model, an ONNX file, or (--backend dense) a plain HF checkpoint with the masks folded in."""
    result = lower_artifact(LowerConfig(artifact_dir, out, backend, onnx_standard_ops, dtype, model=model,
                                        overwrite=overwrite, trust_remote_code=trust_remote_code,
                                        compile=compile_, max_len=max_len, quantize=quantize))
    if backend == "dense":
        click.echo(f"folded {artifact_dir} -> {result.path} (HF checkpoint; pruned groups are zeros)")
        return
    ratio = result.packed_bytes / max(result.dense_bytes, 1)
    click.echo(f"lowered {artifact_dir} -> {result.path} (backend {backend}; target weights "
               f"{result.packed_bytes / 2**20:.1f} MiB packed = {ratio:.3f}x dense"
               + (f"; compiled prefill/decode programs, {max_len} positions)" if compile_ else ")"))
