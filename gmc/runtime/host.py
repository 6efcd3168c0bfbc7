"""The machine gmc runs on, as benchmarks record it and ``gmc env`` prints it.

A speed figure means little without its host: the CPU model, the vector ISA its kernels can use
(AVX2 / AVX-512 / AMX decide which code torch and gmc's C++ kernel run), the core count, and a
copy bandwidth measured in the same run, since decode is bound by how fast weights stream from
memory. ``environment`` adds what was installed and what loads (gmc's C++ CPU kernel, CUDA,
Triton), the first things to check when a number or a kernel path differs between machines.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

PACKAGES = ("gmc", "torch", "transformers", "triton", "onnxruntime", "onnxruntime-gpu", "onnxruntime-genai",
            "onnxruntime-extensions", "onnx")
# /proc/cpuinfo flag -> the name a host line gives it, in increasing capability
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI", "avx512_bf16": "AVX512-BF16",
             "amx_tile": "AMX"}


def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def isa_flags() -> list[str]:
    """The vector extensions of ``ISA_FLAGS`` the CPU reports (x86 Linux; empty elsewhere)."""
    flags = set(_cpuinfo().get("flags", "").split())
    return [name for flag, name in ISA_FLAGS.items() if flag in flags]


def host() -> dict:
    """What a benchmark record states about its machine (the copy bandwidth is measured apart): the
    CPU's ISA, and the ISA the code ran for (torch's CPU capability, the ``-march`` of gmc's kernel,
    ``x86-64-v3`` where ``GMC_CPU_KERNEL`` asks for the AVX2 build on an AVX-512 host)."""
    from gmc.kernels.cpu_group_sparse import march

    return {"cpu": cpu_model(), "isa": isa_flags(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "gmc_kernel_march": march(), "cores": os.cpu_count(), "torch": torch.__version__}


def copy_bandwidth_gbs(threads: int, repeats: int = 5, mib: int = 256) -> float:
    """GB/s read + written by a ``mib`` MiB ``copy_`` on ``threads`` threads (median of ``repeats``),
    the roofline of a step that streams its weights; torch's thread count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(mib * 2**20 // 4)  # fp32
        target = torch.empty_like(source)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * source.numel() * 4 / statistics.median(times) / 1e9


def environment() -> dict:
    """Versions, host, and which of gmc's kernel paths load here (``gmc env``). Asking for the C++
    CPU kernel builds it when this machine has not yet (about 40 s, once), as its first use would."""
    from gmc.kernels.cpu_group_sparse import backend, kernel

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    cuda = torch.cuda.is_available()
    return {
        "versions": versions,
        "python": platform.python_version(),
        "executable": sys.executable,
        **host(),
        "cpu_kernel": {"loads": kernel() is not None, "backend": backend()},
        "cuda": {"available": cuda, "version": torch.version.cuda,
                 "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []},
        "triton": _triton(cuda),
    }


def _triton(cuda: bool) -> dict:
    """Installed, and usable: gmc runs its Triton kernels on CUDA devices (the CPU only interprets them)."""
    if importlib.util.find_spec("triton") is None:
        return {"installed": False, "usable": False, "why": "not installed (pip install triton)"}
    try:
        import triton  # noqa: F401
    except Exception as error:  # a broken install raises more than ImportError
        return {"installed": True, "usable": False, "why": f"import failed: {str(error).splitlines()[0][:160]}"}
    return {"installed": True, "usable": cuda, "why": "" if cuda else "no CUDA device (the CPU only interprets it)"}


def environment_lines(env: dict) -> list[str]:
    """``environment()`` as the lines ``gmc env`` prints."""
    cuda, kernel = env["cuda"], env["cpu_kernel"]
    return [
        "versions: " + ", ".join(f"{name} {version}" for name, version in env["versions"].items()),
        f"python: {env['python']} ({env['executable']})",
        f"cpu: {env['cpu']}, {env['cores']} cores; ISA {' '.join(env['isa']) or 'none reported'} "
        f"(torch uses {env['torch_cpu_capability']})",
        f"gmc C++ CPU kernel: {'loads' if kernel['loads'] else 'not loaded'}: {kernel['backend']}",
        "cuda: " + (f"{cuda['version']}, " + ", ".join(cuda["devices"]) if cuda["available"] else "not available"),
        "triton: " + ("usable" if env["triton"]["usable"] else f"not usable: {env['triton']['why']}"),
    ]
