"""CUDA programs compile gmc's ops in: each op traced into what it runs when Inductor compiles it.

On CPU a compiled package calls gmc's C++ kernels through their C shims (``gmc.formats.compiled``). On CUDA
an op's implementation is Python (the Triton wrapper of ``triton_group_sparse.py``, the gated MLP's
two products and activation): an AOTInductor package could reach it only through the dispatcher
of a process that imported gmc, and Inductor would not see into it. So each op gets the rule
``torch.library.triton_op`` gives the ops it defines, for ops gmc defines itself (one schema, CPU
kernel in C++): when AOTDispatcher functionalizes a graph for Inductor (AOTInductor,
``torch.compile``) and the op's inputs are CUDA tensors, the call is replaced by its
implementation traced op by op, each Triton launch (``torch.library.wrap_triton``) a
``triton_kernel_wrapper_functional`` node that Inductor autotunes and compiles into the package::

    exported program     ...  gmc.group_sparse_linear(x, values, ...)  ...      (torch.export keeps the op)
    Inductor's graph     ...  zeros -> triton_kernel_wrapper_functional(_decode_kernel, ...) -> add bias ...

``torch.export`` keeps the op (it turns this off, as for ``triton_op``: the exported program stays
free of Triton source and serialisable), and so do CPU inputs (the C++ kernel is the extern call).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode


def inline_on_cuda(name: str, lib: torch.library.Library, implementation: Callable[..., torch.Tensor]) -> None:
    """Trace ``name``'s CUDA calls into ``implementation`` (same arguments) when Inductor functionalizes them."""

    def rule(mode, op, types, args, kwargs):
        # torch.export sets decompose_custom_triton_ops off while it traces (what triton_op reads)
        if not torch._functorch.config.decompose_custom_triton_ops or args[0].device.type != "cuda":
            return mode.__torch_dispatch__(op, types, args, kwargs)
        if any(not issubclass(t, (FakeTensor, FunctionalTensor)) and t is not torch.Tensor for t in types):
            return NotImplemented  # a tensor subclass: let it handle the op first
        with mode:
            return implementation(*args, **kwargs)

    torch.library.register_torch_dispatch(name, FunctionalTensorMode, rule, lib=lib)
