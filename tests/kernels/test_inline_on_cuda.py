"""CUDA programs trace gmc's ops into their Triton kernels and torch ops (``gmc.kernels.inline_on_cuda``).

There is no GPU here, so the trace runs on fake CUDA tensors: AOTDispatcher's functionalized trace
(what AOTInductor compiles) must hold no gmc op and one ``triton_kernel_wrapper_functional`` per
product, while ``torch.export`` and CPU inputs keep the op. The interpreter cannot be on for that
trace (interpreted kernels are not JIT functions Inductor can take), so it runs in a child process
without ``TRITON_INTERPRET``; the launch path the trace records is checked for numbers here, under
the interpreter.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

triton_group_sparse = pytest.importorskip("gmc.kernels.triton_group_sparse")

_TRACE_SCRIPT = textwrap.dedent("""
    import collections, json, logging
    import torch
    from torch._functorch.aot_autograd import aot_export_module
    from torch._subclasses.fake_tensor import FakeTensorMode
    from gmc.groups import parse_pattern
    from gmc.kernels.gated_mlp import group_sparse_gated_mlp
    from gmc.kernels.group_sparse_linear import group_sparse_linear
    from gmc.kernels.packed import pack
    from gmc.kernels.tiled import tile

    # without a GPU, triton cannot compile a kernel to find what it writes, and says so per launch
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
    spec = parse_pattern("1x64")
    gen = torch.Generator().manual_seed(0)
    def layer(d_out, d_in):
        weight = torch.randn(d_out, d_in, generator=gen)
        packed = pack(weight, torch.rand(spec.grid((d_out, d_in)), generator=gen) > 0.5, spec, torch.randn(d_out))
        tiled = tile(packed.values, packed.row_idx, packed.row_ptr, None, d_out, d_in, 64)
        return packed, tiled
    (up, up_tiled), (down, down_tiled) = layer(192, 128), layer(128, 96)  # gate | up of d_ff 96, then down

    class Program(torch.nn.Module):
        def __init__(self, device, mlp):
            super().__init__()
            if device == "cuda":  # the layout the CUDA kernel reads (tile_for_cuda, GroupSparseLinear on CUDA)
                tensors = [up_tiled.values, up_tiled.entries, up_tiled.tile_ptr, up.bias,
                           down_tiled.values, down_tiled.entries, down_tiled.tile_ptr, down.bias]
            else:
                tensors = [up.values, up.row_idx, up.row_ptr, up.bias,
                           down.values, down.row_idx, down.row_ptr, down.bias]
            for i, t in enumerate(tensors):  # fake CUDA buffers: empty_strided under the fake mode
                self.register_buffer(f"t{i}", torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))
            self.mlp = mlp
        def forward(self, x):
            if self.mlp:
                return (group_sparse_gated_mlp(x, self.t0, self.t1, self.t2, self.t3, self.t4, self.t5, self.t6,
                                               self.t7, 96, 128, 64) * 2,)
            return (group_sparse_linear(x, self.t0, self.t1, self.t2, self.t3, 192, 64) * 2,)

    def calls(gm):  # every call that could launch work, but the program's own "* 2" and its output allocation
        free = ("aten.mul", "aten.empty", "aten.view", "aten._unsafe_view", "aten.alias", "<built-in")
        return dict(collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                                        and not str(n.target).startswith(free)))
    found = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for device in ("cuda", "cpu"):
            for mlp in (False, True):
                for tokens in (1, 40):  # the decode and the prefill kernel
                    program, x = Program(device, mlp), torch.empty(tokens, 128, device=device)
                    key = f"{device} {'mlp' if mlp else 'linear'} {tokens}"
                    found[key + " inductor"] = calls(aot_export_module(program, [x], trace_joint=False)[0])
                    found[key + " export"] = calls(torch.export.export(program, (x,)).graph_module)
    print(json.dumps(found))
""")


@pytest.mark.slow
def test_cuda_programs_hold_the_triton_kernels_and_export_keeps_the_op():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    linear, mlp = {"gmc.group_sparse_linear.default": 1}, {"gmc.group_sparse_gated_mlp.default": 1}
    for tokens in (1, 40):
        # what Inductor compiles on CUDA: one launch per product (bias and cast inside it, no zero fill,
        # no add, no copy), the activation between the MLP's two, and no op to call back
        assert found[f"cuda linear {tokens} inductor"] == {"triton_kernel_wrapper_functional": 1}
        assert found[f"cuda mlp {tokens} inductor"] == {"triton_kernel_wrapper_functional": 2,
                                                        "aten.silu.default": 1, "aten.split.Tensor": 2}
        # the exported (saved) program keeps the op on CUDA, and every CPU trace keeps it (the C++ kernel)
        assert found[f"cuda linear {tokens} export"] == linear and found[f"cuda mlp {tokens} export"] == mlp
        for stage in ("inductor", "export"):
            assert found[f"cpu linear {tokens} {stage}"] == linear and found[f"cpu mlp {tokens} {stage}"] == mlp


@pytest.mark.parametrize("tokens", [1, 40, 512])
def test_traced_launch_matches_the_reference(packed_case, tokens):
    """``traced=True`` launches through ``torch.library.wrap_triton`` (the path the trace records):
    outside a trace it runs the same kernels, with the same numbers (512 tokens: through the dense weight,
    in a buffer of its own)."""
    from gmc.kernels.tiled import tile

    packed, dense = packed_case("1x256", (96, 576), 0.5)
    tiled = tile(packed.values, packed.row_idx, packed.row_ptr, None, 96, 576, 256)
    x = torch.randn(tokens, 576)
    out = triton_group_sparse.triton_group_sparse_linear(x, tiled.values, tiled.entries, tiled.tile_ptr, packed.bias,
                                                         96, 256, traced=True)
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)
