"""``gmc lower``: a masks artifact -> packed group-sparse model (torch, triton) or ONNX file."""
from __future__ import annotations

import dataclasses

import click

from gmc.lowered import BACKENDS, LowerConfig, lower_artifact
from gmc.model import DTYPES

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LowerConfig)}


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--backend", type=click.Choice(BACKENDS), default=_DEFAULTS["backend"], show_default=True,
              help="torch: packed directory, CPU op; triton: same directory, CUDA Triton kernels; onnx: .onnx file")
@click.option("--onnx-standard-ops", is_flag=True,
              help="with --backend onnx: standard ONNX ops instead of the gmc::GroupSparseLinear custom op")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=_DEFAULTS["dtype"], show_default=True,
              help="dtype of the stored weights")
@click.option("-o", "--out", required=True, type=click.Path(), help="output directory (torch, triton) or .onnx file")
@click.option("--overwrite", is_flag=True, help="Replace an existing lowered model / ONNX file that gmc wrote at -o.")
@click.option("--model", default=None, help="Dense base model [default: the one named in the artifact's manifest].")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run the model repository's own Python code.")
def lower(artifact_dir, backend, onnx_standard_ops, dtype, out, overwrite, model, trust_remote_code):
    """Lower the masks in ARTIFACT_DIR (from `gmc prune`) to a packed group-sparse model."""
    result = lower_artifact(LowerConfig(artifact_dir, out, backend, onnx_standard_ops, dtype, model=model,
                                        overwrite=overwrite, trust_remote_code=trust_remote_code))
    ratio = result.packed_bytes / max(result.dense_bytes, 1)
    click.echo(f"lowered {artifact_dir} -> {result.path} (backend {backend}; target weights "
               f"{result.packed_bytes / 2**20:.1f} MiB packed = {ratio:.3f}x dense)")
