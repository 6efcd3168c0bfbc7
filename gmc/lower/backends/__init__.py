"""The lowering backends, one module each, and the table ``gmc lower`` reads.

A new backend is one new module with one ``Backend`` subclass (``gmc.lower.backend``) and one line
here. ``ALIASES`` keep the names of the packed backend on a device: ``torch`` (the CPU op) and
``triton`` (the CUDA op).
"""
from __future__ import annotations

from gmc.lower.backend import Backend
from gmc.lower.backends.dense import DenseBackend
from gmc.lower.backends.onnx import OnnxBackend
from gmc.lower.backends.packed import PackedBackend

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (PackedBackend(), OnnxBackend(), DenseBackend())}
ALIASES = {"torch": ("packed", "cpu"), "triton": ("packed", "cuda")}  # name -> (backend, device)
BACKEND_HELP = "; ".join([*(f"{b.name}: {b.help}" for b in BACKENDS.values()),
                          *(f"{a}: {name} for --device {device}" for a, (name, device) in ALIASES.items())])
