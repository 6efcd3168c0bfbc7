"""Kernel tests run the Triton kernels on CPU through the interpreter.

``TRITON_INTERPRET`` must be set before triton is imported, so it is set here, at collection.
The packed-layer builders these tests share (``GROUP_CASES``, ``packed_case``) are in ``tests/conftest.py``.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
