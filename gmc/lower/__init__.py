"""The lowering stage: a masks artifact -> something that runs (``gmc lower``).

    load the artifact, the base model -> check they match -> the backend writes its output
      packed: pack_targets, the LOWER pass list -> a packed HF checkpoint + the lowered program
              [--compile: prefill/decode programs, AOTInductor packages (``gmc.lower.compile``)]
      onnx:   onnxruntime-genai's model builder on the folded model, then the packing pass over its
              ONNX graph (``gmc.lower.onnx_pack``) -> a directory onnxruntime-genai generates from
      dense:  the masks folded into a plain HF checkpoint

A backend is one module of ``gmc.lower.backends`` (its table: ``BACKENDS``); the device it targets
is an option of its own (``--device``), and ``--backend torch`` / ``--backend triton`` name the
packed backend on the CPU / on CUDA.
"""
from gmc.lower.stage import LowerConfig, LowerResult, lower_artifact

__all__ = ["LowerConfig", "LowerResult", "lower_artifact"]
