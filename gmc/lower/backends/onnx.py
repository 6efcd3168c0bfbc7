"""``--backend onnx``: a directory onnxruntime-genai generates from (``gmc.formats.onnx``).

    fold the masks into the model (pruned groups are zeros) -> onnxruntime-genai's model builder
      writes the dense decoder (KV cache, fused attention and norms, MatMul weights)
      -> the packing pass puts gmc's op in place of each pruned MatMul (``gmc.lower.onnx_pack``)
      -> the directory, with gmc's op library beside the model

The op is ``gmc.GroupSparseLinear``, run by gmc's native ONNX Runtime library
(``gmc.kernels.ort_ops``); with ``--onnx-standard-ops``, or where the library cannot be built here
(said in one line), the same packing in standard ONNX ops that every runtime opens.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from gmc.errors import GmcError
from gmc.formats.hf_checkpoint import save_dense
from gmc.graph.pipeline import fold
from gmc.lower.backend import PROVENANCE, Backend, LowerResult, target_bytes

BUILDER = "onnxruntime_genai.models.builder"


class OnnxBackend(Backend):
    name = "onnx"
    help = "a directory onnxruntime-genai generates from (KV cache, gmc's native op)"
    kind = "onnx"
    options = ("onnx_standard_ops", "quantize")

    def check(self, config) -> None:
        super().check(config)
        if config.onnx_standard_ops and config.quantize != "none":
            raise GmcError(f"--quantize {config.quantize} needs the gmc.GroupSparseLinear op: standard ONNX ops run "
                           "float weights (drop --onnx-standard-ops, or --quantize none)")
        if not config.onnx_standard_ops:
            from gmc.kernels.ort_ops import library_path, why_not

            if library_path() is None and config.quantize != "none":
                raise GmcError(f"--quantize {config.quantize} needs gmc's ONNX Runtime op library, which is not "
                               f"available here: {why_not()}")

    def steps(self, config) -> int:
        return 5

    def write(self, config, artifact, loaded, steps) -> LowerResult:
        import onnx

        from gmc.formats.onnx import MODEL_FILE, save_onnx_dir
        from gmc.lower.onnx_pack import pack_onnx

        library, standard_ops = None, config.onnx_standard_ops
        if not standard_ops:
            from gmc.kernels.ort_ops import library_path, why_not

            library = library_path()
            if library is None:
                print(f"gmc lower: standard ONNX ops instead of gmc's op: {why_not()}", file=sys.stderr)
                standard_ops = True
        _check_builder_reads_the_head(loaded.model)
        steps("folding the masks")
        fold(loaded.model, artifact.masks, artifact.pattern, artifact.weights, in_place=True)
        dense = target_bytes(loaded.model, artifact.masks)
        output = Path(config.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.build-") as work:
            work = Path(work)
            steps("saving the folded model for the model builder")
            save_dense(loaded.model, loaded.tokenizer, work / "hf")
            steps("building the dense decoder (onnxruntime-genai's model builder)")
            model_builder(work / "hf", work / "onnx", work / "cache")
            steps("packing the pruned MatMuls")
            model = onnx.load(str(work / "onnx" / MODEL_FILE))
            packed = pack_onnx(model, artifact.pattern, config.quantize, standard_ops)
            metadata = {key: artifact.manifest[key] for key in PROVENANCE if key in artifact.manifest}
            metadata.update(backend=self.name, source_artifact=str(config.artifact), quantize=config.quantize,
                            op="standard ONNX ops" if standard_ops else "gmc.GroupSparseLinear",
                            packed_layers=packed.layers, kept_weights=packed.kept, layer_weights=packed.weights)
            steps("saving the ONNX directory")
            save_onnx_dir(model, work / "onnx", output, library, metadata, config.overwrite)
        return LowerResult(output, packed.packed_bytes, dense)


def _check_builder_reads_the_head(model) -> None:
    """The model builder takes every linear with ``vocab_size`` outputs for the output head (and
    wires the graph's logits to the last it meets): refuse a model where another one has that width."""
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    clash = next((name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
                  and module is not head and module.out_features == vocab), None)
    if clash is not None:
        raise GmcError(f"{clash} has {vocab} outputs, the vocabulary size: onnxruntime-genai's model builder would "
                       "take it for the output head; lower this model with --backend packed or dense")


def model_builder(hf_dir: Path, output: Path, cache: Path, precision: str = "fp32",
                  extra_options: Sequence[str] = ()) -> None:
    """onnxruntime-genai's model builder on a HF directory, for the CPU, in a child process (it
    prints as it goes; its output is shown only when it fails, as one line); ``extra_options``:
    its ``KEY=VALUE`` options."""
    command = [sys.executable, "-m", BUILDER, "-i", str(hf_dir), "-o", str(output), "-p", precision, "-e", "cpu",
               "-c", str(cache), *(["--extra_options", *extra_options] if extra_options else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise GmcError(f"could not run onnxruntime-genai's model builder: {error}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).strip().splitlines() if line.strip()]
        last = lines[-1][:300] if lines else f"exit status {done.returncode}"
        if "No module named" in last:
            last += " (pip install onnxruntime-genai onnxscript)"
        raise GmcError(f"onnxruntime-genai's model builder failed on the folded model: {last}")
