"""The compiled CPU kernel (``gmc/kernels/cpu_group_sparse.cpp``) against the dense masked reference.

Every product the kernel can choose (stream, register tiles, per-block GEMM) is forced on the
grid of issue 4, single- and multi-threaded; the auto choice is tested through the op in
``test_group_sparse_linear.py``. With a compiler on the machine the compiled path must be the one
that runs (the torch fallback is only for machines that cannot build it).
"""
import shutil

import pytest
import torch
import torch.nn.functional as F

from gmc.kernels import cpu_group_sparse
from gmc.kernels.group_sparse_linear import (
    cpu_backend,
    group_sparse_linear,
    group_sparse_linear_cpu,
    group_sparse_linear_torch,
    rows_ascending,
)

from .conftest import CASES

PATHS = {"stream": 1, "tiles": 2, "gemm": 3}


@pytest.fixture(scope="module")
def kernel():
    module = cpu_group_sparse.kernel()
    if module is None:
        pytest.skip(f"CPU kernel not compiled: {cpu_backend()}")
    return module


def _forward(kernel, x, packed, path):
    bias = packed.bias
    return kernel.forward(x, packed.values, packed.row_idx, packed.row_ptr, bias, packed.shape[0], packed.spec.g_in, path)


def test_compiled_kernel_runs_when_a_compiler_exists(monkeypatch):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the torch fallback runs")
    monkeypatch.delenv(cpu_group_sparse.ENV_SWITCH, raising=False)
    assert cpu_group_sparse.kernel() is not None, cpu_backend()
    assert cpu_backend().startswith("compiled")


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("group,shape", CASES)
@pytest.mark.parametrize("tokens", [1, 7, 128])
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_kernel_paths_match_dense_masked_reference(kernel, packed_case, path, group, shape, tokens, sparsity):
    packed, dense = packed_case(group, shape, sparsity)
    x = torch.randn(tokens, shape[1])
    out = _forward(kernel, x, packed, PATHS[path])
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_kernel_multithreaded_large_layer(kernel, packed_case, path, tokens):
    """Above the parallel threshold each thread owns a row range: split points inside blocks,
    ragged last ranges and stream chunks longer than one accumulator (1024 rows)."""
    packed, dense = packed_case("1x64", (2600, 200), 0.2)
    x = torch.randn(tokens, 200)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = _forward(kernel, x, packed, PATHS[path])
            torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_unsorted_rows_take_the_torch_path(packed_case):
    packed, dense = packed_case("1x64", (128, 320), 0.3)
    ptr = packed.row_ptr.tolist()
    rows = packed.row_idx.clone()
    rows[ptr[0] : ptr[1]] = rows[ptr[0] : ptr[1]].flip(0)  # block 0 descending
    values = packed.values.clone()
    n0 = ptr[1] - ptr[0]
    values[: 64 * n0] = values[: 64 * n0].view(64, n0).flip(1).flatten()  # same weights, same order as rows
    assert not rows_ascending(rows, packed.row_ptr) and rows_ascending(packed.row_idx, packed.row_ptr)
    assert cpu_group_sparse.kernel() is None or not cpu_group_sparse.kernel().rows_ascending(rows, packed.row_ptr, 128)
    x = torch.randn(5, 320)
    out = group_sparse_linear_cpu(x, values, rows, packed.row_ptr, packed.bias, 128, 64)
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


def test_kernel_rejects_inconsistent_packed_tensors(kernel, packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    x = torch.randn(2, 320)
    with pytest.raises(RuntimeError, match="packed layer"):
        kernel.forward(x, packed.values[:-1].contiguous(), packed.row_idx, packed.row_ptr, None, 128, 64, 0)
    with pytest.raises(RuntimeError, match="row_ptr"):
        kernel.forward(x, packed.values, packed.row_idx, packed.row_ptr[:-1].contiguous(), None, 128, 64, 0)
    assert not kernel.rows_ascending(packed.row_idx, packed.row_ptr, int(packed.row_idx.max()))


def test_op_int32_rows_and_3d_input(packed_case):
    packed, dense = packed_case("1x256", (96, 576), 0.5)
    x = torch.randn(2, 3, 576)
    out = group_sparse_linear(x, packed.values, packed.row_idx.int(), packed.row_ptr, packed.bias, 96, 256)
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


def test_torch_fallback_when_switched_off(monkeypatch, packed_case):
    monkeypatch.setattr(cpu_group_sparse, "_state", {})
    monkeypatch.setenv(cpu_group_sparse.ENV_SWITCH, "torch")
    assert cpu_group_sparse.kernel() is None and "GMC_CPU_KERNEL" in cpu_backend()
    packed, dense = packed_case("32x32", (100, 70), 0.5)
    x = torch.randn(7, 70)
    args = (x, packed.values, packed.row_idx, packed.row_ptr, packed.bias, 100, 32)
    torch.testing.assert_close(group_sparse_linear(*args), group_sparse_linear_torch(*args))


def test_build_failure_falls_back_with_a_reason(monkeypatch, packed_case):
    def broken_build():
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setattr(cpu_group_sparse, "_state", {})
    monkeypatch.delenv(cpu_group_sparse.ENV_SWITCH, raising=False)
    monkeypatch.setattr(cpu_group_sparse, "_build", broken_build)
    with pytest.warns(RuntimeWarning, match="torch path"):
        assert cpu_group_sparse.kernel() is None
    assert "build failed" in cpu_backend() and "g++ not found" in cpu_backend()
    packed, dense = packed_case("1x64", (128, 320), 0.5)
    x = torch.randn(3, 320)
    out = group_sparse_linear(x, packed.values, packed.row_idx, packed.row_ptr, packed.bias, 128, 64)
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)
