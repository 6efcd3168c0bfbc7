"""The compiled CPU kernel (``gmc/kernels/cpu_group_sparse.cpp``) against the dense masked reference.

Every product the kernel can choose (stream, register tiles, per-block GEMM) is forced on the
group shapes of ``conftest.GROUP_CASES``, single- and multi-threaded; the auto choice is tested through
the op in ``test_group_sparse_linear.py``. With a compiler on the machine the compiled kernel must be the
op's CPU implementation, reached without Python (the torch fallback is only for machines that
cannot build it, other dtypes and indices the kernel refuses). Last, the kernel is loaded only
from a private build directory.
"""
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import GROUP_CASES

from gmc.errors import GmcError
from gmc.kernels import cpu_group_sparse
from gmc.kernels import group_sparse_linear as op_module
from gmc.kernels.group_sparse_linear import cpu_backend, group_sparse_linear

PATHS = {"stream": 1, "tiles": 2, "gemm": 3}


def _forward(kernel, x, packed, path):
    bias = packed.bias
    return kernel.forward(x, packed.values, packed.row_idx, packed.row_ptr, bias, packed.shape[0], packed.spec.g_in,
                          path)


@pytest.fixture
def torch_calls(count_calls):
    """Counts the calls of the op's torch implementation."""
    return count_calls(op_module, "group_sparse_linear_torch")


def test_compiled_kernel_is_the_ops_cpu_implementation(monkeypatch, packed_case, torch_calls):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the torch fallback runs")
    monkeypatch.delenv(cpu_group_sparse.ENV_SWITCH, raising=False)
    assert cpu_group_sparse.kernel() is not None, cpu_backend()
    assert cpu_backend().startswith("compiled")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("gmc::group_sparse_linear", "CPU")
    packed, dense = packed_case("1x256", (96, 576), 0.5)
    x = torch.randn(1, 1, 576)
    out = group_sparse_linear(x, packed.values, packed.row_idx, packed.row_ptr, packed.bias, 96, 256)
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)
    assert torch_calls == []  # dispatcher -> C++, no Python implementation in between


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("group,shape", GROUP_CASES)
@pytest.mark.parametrize("tokens", [1, 13, 128])  # 13: whole and partial tiles of 6 and of 8 tokens
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_kernel_paths_match_dense_masked_reference(kernel, packed_case, path, group, shape, tokens, sparsity):
    packed, dense = packed_case(group, shape, sparsity)
    x = torch.randn(tokens, shape[1])
    out = _forward(kernel, x, packed, PATHS[path])
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_kernel_multithreaded_large_layer(kernel, packed_case, path, tokens):
    """Above the parallel threshold the stream cuts the layer's k rows, block after block, into one
    run of equal weight per thread (partial outputs added; blocks 0, 2 and the ragged 8-wide 3 are
    kept: two threads cut inside block 2, three inside blocks 0 and 2, the last block whole to the
    last thread) and tiles/gemm give each thread a row range: split points inside blocks and
    ragged last ranges."""
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


@pytest.mark.parametrize("group,shape,tokens", [("1x16", (70000, 16), 1), ("1x64", (20000, 64), 4)])
def test_stream_sweeps_blocks_longer_than_its_accumulator(kernel, packed_case, group, shape, tokens):
    """A block keeping more rows than the stream's accumulator holds for T tokens (65536 / T) is
    swept in several chunks, the last one ragged."""
    packed, dense = packed_case(group, shape, 0.05)
    assert int(packed.row_ptr[1] - packed.row_ptr[0]) > 65536 // tokens
    x = torch.randn(tokens, shape[1])
    out = _forward(kernel, x, packed, PATHS["stream"])
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens,threads", [(5, 1), (1, 1), (1, 2)])
def test_unsorted_rows_take_the_torch_path(kernel, packed_case, torch_calls, tokens, threads):
    """For every product: tiles (5 tokens) and the stream (1 token, on one thread and with k split
    across two)."""
    packed, dense = packed_case("1x64", (1024, 320), 0.3)
    ptr = packed.row_ptr.tolist()
    rows = packed.row_idx.clone()
    rows[ptr[0] : ptr[1]] = rows[ptr[0] : ptr[1]].flip(0)  # block 0 descending
    values = packed.values.clone()
    n0 = ptr[1] - ptr[0]
    values[: 64 * n0] = values[: 64 * n0].view(64, n0).flip(1).flatten()  # same weights, same order as rows
    x = torch.randn(tokens, 320)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = group_sparse_linear(x, values, rows, packed.row_ptr, packed.bias, 1024, 64)
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)
    assert torch_calls == [1]
    with pytest.raises(RuntimeError, match="packed layer"):  # the strict entry refuses them
        kernel.forward(x, values, rows, packed.row_ptr, packed.bias, 1024, 64, 0)


@pytest.mark.parametrize("chunk", [0, 1])
def test_decode_never_writes_at_a_row_beyond_d_out(packed_case, torch_calls, chunk):
    """A kept row past d_out inside a block (its first and last rows fine), in the first or the
    second of the stream's chunks: never added at; the torch implementation, which raises, gets
    the call."""
    packed, _ = packed_case("1x16", (70000, 16), 0.05)
    rows = packed.row_idx.clone()
    rows[100 if chunk == 0 else 65536 + 100] = 70000 + 10 ** 6
    with pytest.raises((RuntimeError, IndexError)):
        group_sparse_linear(torch.randn(1, 16), packed.values, rows, packed.row_ptr, None, 70000, 16)
    assert torch_calls == [1]


def test_kernel_rejects_inconsistent_packed_tensors(kernel, packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    x = torch.randn(2, 320)
    with pytest.raises(RuntimeError, match="packed layer"):
        kernel.forward(x, packed.values[:-1].contiguous(), packed.row_idx, packed.row_ptr, None, 128, 64, 0)
    with pytest.raises(RuntimeError, match="row_ptr"):
        kernel.forward(x, packed.values, packed.row_idx, packed.row_ptr[:-1].contiguous(), None, 128, 64, 0)
    with pytest.raises(RuntimeError, match="packed layer"):  # a kept row beyond d_out
        kernel.forward(x, packed.values, packed.row_idx, packed.row_ptr, None, int(packed.row_idx.max()), 64, 0)


def test_op_never_reads_past_inconsistent_packed_tensors(packed_case):
    """Blocks that do not fill the values are refused at the op's entry; a row index past the output
    (not read by the entry check) goes to the torch implementation, which raises rather than read
    outside the buffers."""
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    x = torch.randn(2, 320)
    with pytest.raises(GmcError, match="values"):
        group_sparse_linear(x, packed.values[:-1].clone(), packed.row_idx, packed.row_ptr, None, 128, 64)
    with pytest.raises((RuntimeError, IndexError)):
        group_sparse_linear(x, packed.values, packed.row_idx, packed.row_ptr, None, int(packed.row_idx.max()), 64)


def test_op_int32_rows_and_3d_input(packed_case):
    packed, dense = packed_case("1x256", (96, 576), 0.5)
    x = torch.randn(2, 3, 576)
    out = group_sparse_linear(x, packed.values, packed.row_idx.int(), packed.row_ptr, packed.bias, 96, 256)
    torch.testing.assert_close(out, F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


# A fresh process: the switch is read, and the build tried, once per process (a loaded kernel
# stays the op's CPU implementation), so the fallbacks are tested where nothing was loaded yet.
_FALLBACK_SCRIPT = textwrap.dedent("""
    import warnings
    import torch, torch.nn.functional as F
    from gmc.groups import GroupSpec
    from gmc.kernels.group_sparse_linear import cpu_backend, group_sparse_linear
    from gmc.kernels.packed import pack
    spec = GroupSpec(32, 32)
    keep = (torch.rand(spec.grid((100, 70))) >= 0.5).float()
    packed = pack(torch.randn(100, 70), keep, spec, torch.randn(100))
    x = torch.randn(7, 70)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = group_sparse_linear(x, packed.values, packed.row_idx, packed.row_ptr, packed.bias, 100, 32)
    torch.testing.assert_close(out, F.linear(x, packed.unpack(), packed.bias), atol=1e-4, rtol=1e-4)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("gmc::group_sparse_linear", "CPU")
    print("backend:", cpu_backend())
    print("warned:", "|".join(str(w.message) for w in caught if w.category is RuntimeWarning))
""")


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["switched_off", "no_compiler"])
def test_torch_fallback_in_a_process_without_the_kernel(tmp_path, broken):
    env = dict(os.environ, GMC_CACHE=str(tmp_path / "cache"), PYTHONPATH=os.getcwd())
    if broken == "switched_off":
        env[cpu_group_sparse.ENV_SWITCH] = "torch"
    else:
        env.pop(cpu_group_sparse.ENV_SWITCH, None)
        env["CXX"] = str(tmp_path / "no-such-compiler")
    result = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if line.startswith(("backend:", "warned:")))
    if broken == "switched_off":
        assert lines["backend"] == "torch (GMC_CPU_KERNEL=torch)" and lines["warned"] == ""
    else:
        assert lines["backend"].startswith("torch (C++ build failed") and "using the torch path" in lines["warned"]


# The compiled kernel is imported only from a private build directory: a
# library planted where another user could write is never loaded; gmc warns and runs the torch path.


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """A kernel state that has loaded nothing yet, a private cache, and a loader that only records."""
    import torch.utils.cpp_extension

    monkeypatch.setattr(cpu_group_sparse, "_state", {})
    monkeypatch.delenv(cpu_group_sparse.ENV_SWITCH, raising=False)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("GMC_CACHE", str(cache))
    loads = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: loads.append(kwargs) or "module")
    return cache, loads


def test_kernel_builds_into_a_private_directory(fresh_kernel):
    cache, loads = fresh_kernel
    assert cpu_group_sparse.kernel() == "module" and len(loads) == 1
    for directory in (cache / "cpu_kernels", cache / "cpu_kernels" / loads[0]["name"]):
        info = directory.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()


def test_two_checkouts_of_one_source_share_one_build(fresh_kernel, monkeypatch, tmp_path):
    """The build compiles copies inside its private directory, so its command names no checkout: a
    second checkout (a clone, a worktree) of the same text reuses the build, and the copies are only
    rewritten when the text changes (a rewrite would make ninja compile again)."""
    cache, loads = fresh_kernel
    builds = []
    for checkout in ("clone", "worktree"):
        kernels = tmp_path / checkout / "gmc" / "kernels"
        kernels.mkdir(parents=True)
        for path in (cpu_group_sparse.SOURCE, *cpu_group_sparse.HEADERS):
            (kernels / path.name).write_text(path.read_text())
        monkeypatch.setattr(cpu_group_sparse, "SOURCE", kernels / cpu_group_sparse.SOURCE.name)
        monkeypatch.setattr(cpu_group_sparse, "HEADERS", tuple(kernels / p.name for p in cpu_group_sparse.HEADERS))
        monkeypatch.setattr(cpu_group_sparse, "_state", {})
        assert cpu_group_sparse.kernel() == "module"
        (source,) = loads[-1]["sources"]
        builds.append((loads[-1]["name"], source, Path(source).stat().st_mtime_ns))
        os.utime(source, ns=(10**18, 10**18))  # a rewrite by the second checkout would show
    assert builds[1] == (*builds[0][:2], 10**18)  # one directory, one source path, not rewritten
    name, source, _ = builds[0]
    assert Path(source).parent == cache / "cpu_kernels" / name
    assert Path(source).read_text() == cpu_group_sparse.SOURCE.read_text()
    header = cpu_group_sparse.HEADERS[0]
    header.write_text(header.read_text() + "\n// changed\n")  # new text: a new build directory, its own copies
    monkeypatch.setattr(cpu_group_sparse, "_state", {})
    assert cpu_group_sparse.kernel() == "module" and loads[-1]["name"] != name
    assert (Path(loads[-1]["sources"][0]).parent / header.name).read_text().endswith("// changed\n")


@pytest.mark.parametrize("plant", ["group_writable", "foreign_owner", "symlink", "open_parent"])
def test_kernel_from_a_directory_others_could_write_is_never_loaded(fresh_kernel, monkeypatch, tmp_path, plant):
    cache, loads = fresh_kernel
    kernels = cache / "cpu_kernels"
    if plant == "group_writable":
        kernels.mkdir()
        kernels.chmod(0o777)
    elif plant == "foreign_owner":
        kernels.mkdir(mode=0o700)
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    elif plant == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        kernels.symlink_to(tmp_path / "elsewhere")
    else:
        cache.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="using the torch path"):
        assert cpu_group_sparse.kernel() is None
    assert loads == [] and cpu_group_sparse.backend().startswith("torch")


# A build killed mid-way (Ctrl-C, OOM, a lost machine) left torch's lock file in the build
# directory, and every later `load` of that directory waited for it forever: gmc builds under an
# flock the kernel releases with its holder, and removes the dead build's lock.


def _kernel_build_root(cache) -> "os.PathLike":
    root = cache / "cpu_kernels" / f"gmc_cpu_group_sparse_{cpu_group_sparse._digest()}"
    root.mkdir(parents=True, mode=0o700)
    (cache / "cpu_kernels").chmod(0o700)
    return root


def test_a_killed_builds_lock_does_not_hang_the_next_build(fresh_kernel, monkeypatch):
    import torch.utils.cpp_extension

    cache, loads = fresh_kernel
    root = _kernel_build_root(cache)
    (root / cpu_group_sparse.TORCH_LOCK).write_text("")  # what the killed build left
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda **kwargs: seen.append((root / cpu_group_sparse.TORCH_LOCK).exists()) or "module")
    assert cpu_group_sparse.kernel() == "module" and seen == [False]


def test_a_live_build_is_waited_for_not_broken(fresh_kernel, monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    cache, _ = fresh_kernel
    root = _kernel_build_root(cache)
    done = tmp_path / "other-build-done"
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, pathlib, sys, time
        root = pathlib.Path({str(root)!r})
        with open(root / ".gmc-build.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            (root / "lock").write_text("")
            print("holding", flush=True)
            time.sleep(1.0)
            (root / "lock").unlink()
            pathlib.Path({str(done)!r}).write_text("")
        """)], stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "holding"
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: seen.append(done.exists()) or "module")
    assert cpu_group_sparse.kernel() == "module"
    assert other.wait(timeout=30) == 0 and seen == [True]  # it loaded only after the other build finished


@pytest.mark.parametrize("value,expected", [("", "native"), ("torch", "native"), ("x86-64-v3", "x86-64-v3"),
                                            ("X86-64-V3", "x86-64-v3"), ("native", "native")])
def test_march_follows_the_switch(monkeypatch, value, expected, recwarn):
    monkeypatch.setenv(cpu_group_sparse.ENV_SWITCH, value)
    assert cpu_group_sparse.march() == expected
    assert cpu_group_sparse.flags(expected)[1] == f"-march={expected}"
    assert not recwarn.list


def test_march_warns_on_an_unknown_target_and_builds_native(monkeypatch):
    monkeypatch.setenv(cpu_group_sparse.ENV_SWITCH, "avx2")
    with pytest.warns(RuntimeWarning, match="GMC_CPU_KERNEL=avx2 is not one of torch, native, x86-64-v2"):
        assert cpu_group_sparse.march() == "native"
