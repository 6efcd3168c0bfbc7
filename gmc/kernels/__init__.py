"""The ``gmc::`` ops and the packed layout they read; importing this package registers the ops
(schemas, CPU/Triton/torch implementations, fake kernels), so ``torch.export.load`` of a lowered
program and AOTInductor packages find them.

``group_sparse_linear`` (one packed linear), ``gated_mlp`` (a lowered gated MLP in one call),
``decode_attention`` (attention of one decode step over a static KV cache), ``attention_block`` (a
layer's attention for one token, q/k/v product to o product, in one call), ``packed`` (the BSC
layout and its index checks), ``quantize`` (weight-only int8 and int4), ``cpu_group_sparse`` (the
C++ kernel's build and load), ``triton_group_sparse`` (CUDA), ``onnx_group_sparse`` (the op's
ONNX nodes and schema; imports onnx), ``ort_ops`` (the native ONNX Runtime op library's build and checks).
May import: ``gmc.errors``, ``gmc.config``, ``gmc.groups``.
"""
from gmc.kernels import attention_block, decode_attention, gated_mlp, group_sparse_linear  # noqa: F401  (register the ops)
