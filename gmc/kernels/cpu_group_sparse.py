"""Build and load the fused C++ CPU kernel of ``gmc::group_sparse_linear`` (``cpu_group_sparse.cpp``).

The kernel is compiled at first use with ``torch.utils.cpp_extension.load`` (gcc, ``-O3
-march=native -fopenmp``) into ``$GMC_CACHE/cpu_kernels/<name>`` (default ``~/.cache/gmc``); the
name hashes the source, the torch version and this CPU's model and flags, so a cache shared by
different machines never loads a build for another instruction set. The library found there is
imported, i.e. run: ``cpu_kernels`` and the build directory are created private (0700) and used
only while owned by this user and writable by nobody else (their parent too, unless sticky like
``/tmp``); otherwise gmc warns and runs the torch path rather than import a library another user
could have planted. Builds of one directory take turns under an ``flock`` (``_building``), so a
build killed mid-way never leaves a lock that stalls the next one. If the build or the import
fails (no compiler, no ninja, no headers) ``kernel()`` returns None, ``backend()`` says why, and
the op runs its pure-torch implementation. ``GMC_CPU_KERNEL=torch`` forces that fallback;
``GMC_CPU_KERNEL=x86-64-v3`` (or another of ``MARCHES``) builds for that instruction set instead
of this CPU's, here and in the runtime library of compiled packages: on an AVX-512 host,
``x86-64-v3`` runs the AVX2 code paths most x86 machines take (``bench/bench_decode.py --march``).

Importing the library registers its ``group_sparse_linear``, ``decode_attention`` and
``group_sparse_gated_mlp`` as those ops' CPU kernels (for the rest of the process): from then on
a call of any of them on CPU goes from the dispatcher straight to C++.
The op's torch implementation loads it at the first float32 or bfloat16 CPU call
(``load_at_first_call``). float32 and bfloat16 ``x`` run compiled, with values of ``x``'s dtype or
weight-only int8 (``gmc.kernels.quantize.quantize_int8``); the C++ kernel hands other dtypes back to the
torch implementation.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import stat
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

import torch

from gmc.config import cache_root

SOURCE = Path(__file__).with_name("cpu_group_sparse.cpp")
# the torch-free core it includes (and the ONNX Runtime op, gmc.kernels.ort_ops, too)
HEADERS = (SOURCE.with_name("group_sparse_core.h"), SOURCE.with_name("group_sparse_products.h"))
ENV_SWITCH = "GMC_CPU_KERNEL"  # "torch": never compile, use the torch fallback; one of MARCHES: build for it
# -march targets a build can take: this CPU's, or an x86-64 level (v3: AVX2 + FMA + F16C, no AVX-512)
MARCHES = ("native", "x86-64-v2", "x86-64-v3", "x86-64-v4")

_state: dict = {}


def _cpu_signature() -> str:
    """CPU model and flags: a ``-march=native`` build is only valid on the same instruction set."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


class UnsafeBuildDirectory(RuntimeError):
    """The build directory could hold a library this user did not build: never import from it."""


def build_directory(name: str) -> Path:
    """``$GMC_CACHE/cpu_kernels/<name>``, created 0700 and checked private (see the module docstring)."""
    kernels = cache_root().absolute() / "cpu_kernels"
    kernels.parent.mkdir(parents=True, exist_ok=True)
    _check_not_replaceable(kernels.parent)
    root = kernels / name
    for directory in (kernels, root):
        directory.mkdir(mode=0o700, exist_ok=True)
        _check_private(directory)
    return root


def _check_private(path: Path) -> None:
    """Owned by this user, a real directory, writable by nobody else; made 0700 if others could read it."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeBuildDirectory(f"kernel build directory {path} is not a plain directory (a link?)")
    if info.st_uid != os.getuid():
        raise UnsafeBuildDirectory(f"kernel build directory {path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise UnsafeBuildDirectory(f"kernel build directory {path} is writable by other users "
                                   f"(mode {stat.S_IMODE(info.st_mode):o}); delete it to rebuild")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)


def _check_not_replaceable(path: Path) -> None:
    """Nobody else can rename entries of ``path``: owned by this user or root, and not writable by
    others unless sticky (``/tmp``)."""
    info = path.stat()
    if info.st_uid not in (os.getuid(), 0):
        raise UnsafeBuildDirectory(f"kernel cache {path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafeBuildDirectory(f"kernel cache {path} is writable by other users "
                                   f"(mode {stat.S_IMODE(info.st_mode):o}); set GMC_CACHE to a private directory")


FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]  # the kernel and the runtime library

# Both builds carry this soname: a compiled CPU package links against it (gmc.formats.compiled), and the
# loader resolves that to whichever of the two the process has loaded.
SONAME = "libgmc_ops.so"
# The C declarations of the ops' shims in cpu_group_sparse.cpp, by op name (AOTInductor writes
# them into packages).
C_SHIMS = {
    "group_sparse_linear": ("AOTITorchError aoti_torch_cpu_group_sparse_linear(AtenTensorHandle x, "
                            "AtenTensorHandle values, AtenTensorHandle row_idx, AtenTensorHandle row_ptr, "
                            "AtenTensorHandle* bias, int64_t d_out, int64_t g_in, AtenTensorHandle* scales, "
                            "AtenTensorHandle* out)"),
    "decode_attention": ("AOTITorchError aoti_torch_cpu_decode_attention(AtenTensorHandle q, AtenTensorHandle k, "
                         "AtenTensorHandle v, AtenTensorHandle* mask, double scale, AtenTensorHandle* out)"),
    "group_sparse_gated_mlp": ("AOTITorchError aoti_torch_cpu_group_sparse_gated_mlp(AtenTensorHandle x, "
                               "AtenTensorHandle values, AtenTensorHandle row_idx, AtenTensorHandle row_ptr, "
                               "AtenTensorHandle* bias, AtenTensorHandle down_values, AtenTensorHandle down_row_idx, "
                               "AtenTensorHandle down_row_ptr, AtenTensorHandle* down_bias, int64_t d_ff, "
                               "int64_t d_out, int64_t g_in, AtenTensorHandle* scales, AtenTensorHandle* down_scales, "
                               "AtenTensorHandle* out)"),
    "attention_block": ("AOTITorchError aoti_torch_cpu_attention_block(AtenTensorHandle x, "
                        "AtenTensorHandle qkv_values, AtenTensorHandle qkv_row_idx, AtenTensorHandle qkv_row_ptr, "
                        "AtenTensorHandle* qkv_bias, AtenTensorHandle cos, AtenTensorHandle sin, "
                        "AtenTensorHandle index, AtenTensorHandle keys, AtenTensorHandle values, int64_t length, "
                        "AtenTensorHandle* mask, double scale, AtenTensorHandle o_values, AtenTensorHandle o_row_idx, "
                        "AtenTensorHandle o_row_ptr, AtenTensorHandle* o_bias, int64_t heads, int64_t d_out, "
                        "int64_t g_in, AtenTensorHandle* qkv_scales, AtenTensorHandle* o_scales, "
                        "AtenTensorHandle* out)"),
}


def march() -> str:
    """The ``-march`` gmc builds for: ``$GMC_CPU_KERNEL`` when it names one of ``MARCHES``, else native."""
    value = os.environ.get(ENV_SWITCH, "").lower()
    if value in MARCHES:
        return value
    if value not in ("", "torch"):
        warnings.warn(f"gmc: {ENV_SWITCH}={value} is not one of torch, {', '.join(MARCHES)}: building for native",
                      RuntimeWarning, stacklevel=2)
    return "native"


def flags(target: str = "native") -> list[str]:
    """``FLAGS`` for ``-march=target``."""
    return [flag if not flag.startswith("-march=") else f"-march={target}" for flag in FLAGS]


def _digest(*extra: str) -> str:
    """What a build depends on: the source and its headers, the torch version, this CPU (and ``extra``)."""
    sources = "".join(path.read_text() for path in (SOURCE, *HEADERS))
    return hashlib.sha256((sources + "".join(extra) + torch.__version__ + _cpu_signature()).encode()).hexdigest()[:12]


# torch's own build lock: a file that a killed build leaves behind, after which every later
# ``load`` of that directory waits for it forever
TORCH_LOCK = "lock"


@contextlib.contextmanager
def _building(root: Path):
    """Hold ``root``'s build lock: an ``flock`` the kernel releases when its holder dies. Every gmc
    build in ``root`` runs under it, so torch's lock file found while holding it is a dead build's
    and is removed (a build killed mid-way used to hang every later one)."""
    with open(root / ".gmc-build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (root / TORCH_LOCK).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(target: str = "native") -> ModuleType:
    """The kernel built (or found in the cache) for ``-march=target``: this CPU, or another
    instruction set (``x86-64-v3``: AVX2, no AVX-512), in a process that loads no other."""
    from torch.utils.cpp_extension import load

    name = "gmc_cpu_group_sparse_" + (_digest() if target == "native" else
                                      target.replace("-", "_") + "_" + _digest(target))
    root = build_directory(name)
    with _building(root):
        source = _private_sources(root)
        return load(name=name, sources=[str(source)], build_directory=str(root),
                    extra_cflags=flags(target), extra_ldflags=["-fopenmp", f"-Wl,-soname,{SONAME}"], verbose=False)


def _private_sources(root: Path) -> Path:
    """The source and its headers copied into ``root`` (rewritten only when their text differs), and
    the copy of the source: the build's command then names no checkout, so two checkouts of one
    source (a clone and a worktree) share the build instead of recompiling it at every switch."""
    for path in (SOURCE, *HEADERS):
        copy = root / path.name
        text = path.read_text()
        if not copy.is_file() or copy.read_text() != text:
            copy.write_text(text)
    return root / SOURCE.name


def build_runtime_library(schemas: Sequence[str]) -> Path:
    """The ops' runtime for compiled packages (``gmc.formats.compiled``): this source built with
    ``-DGMC_RUNTIME_LIBRARY`` as a plain shared library that defines ``schemas`` and registers the
    CPU kernels, for ``torch.ops.load_library`` in a process that never imports gmc. It is not
    loaded here: this process already defines the ops (in Python). Cached like the kernel."""
    import subprocess

    from torch.utils.cpp_extension import include_paths, library_paths

    target = march()
    root = build_directory(f"gmc_runtime_{_digest(*schemas, target)}")
    library = root / "libgmc_ops.so"
    with _building(root):  # two processes never write one partial.so
        if library.is_file():  # built by this process or another one
            return library
        (root / "gmc_schema.h").write_text(f"#define GMC_SCHEMAS {{{', '.join(map(json.dumps, schemas))}}}\n")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        command = ["c++", "-shared", "-fPIC", "-std=c++17", *flags(target), "-DGMC_RUNTIME_LIBRARY",
                   f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root}", *(f"-I{path}" for path in include_paths()),
                   str(SOURCE), "-o", str(root / "partial.so"),
                   *(f"-L{path}" for path in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch", "-fopenmp",
                   f"-Wl,-soname,{SONAME}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise RuntimeError(f"building the gmc runtime library failed: {last}")
        os.replace(root / "partial.so", library)  # complete or absent: a killed build is not reused
    return library


def kernel() -> Optional[ModuleType]:
    """The compiled extension module, built at first call; None when it cannot be built."""
    if "module" not in _state:
        if os.environ.get(ENV_SWITCH, "").lower() == "torch":
            _state.update(module=None, backend=f"torch ({ENV_SWITCH}=torch)")
        else:
            try:
                target = march()
                _state.update(module=_build(target), backend="compiled C++ (gmc/kernels/cpu_group_sparse.cpp"
                              + ("" if target == "native" else f", -march={target}") + ")")
            except Exception as error:  # no compiler / ninja / headers: the torch path still works
                reason = str(error).strip().splitlines()[-1:] or [type(error).__name__]
                _state.update(module=None, backend=f"torch (C++ build failed: {reason[0][:200]})")
                warnings.warn(f"gmc: CPU group-sparse kernel not compiled, using the torch path: {reason[0][:200]}",
                              RuntimeWarning, stacklevel=2)
    return _state["module"]


def load_at_first_call() -> bool:
    """Load the kernel if no call has tried yet: True when this call loaded it (the op's CPU
    kernel is then the compiled one), False when it was tried before, is switched off or fails."""
    return "module" not in _state and kernel() is not None


def backend() -> str:
    """Which CPU implementation runs: ``compiled C++ (...)`` or ``torch (<why>)``."""
    kernel()
    return _state["backend"]
