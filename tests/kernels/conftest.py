"""Kernel tests run the Triton kernels on CPU through the interpreter (``TRITON_INTERPRET``, set in
``tests/conftest.py`` before anything imports triton). The packed-layer builders these tests share
(``GROUP_CASES``, ``packed_case``) are in ``tests/conftest.py``.
"""
import pytest


@pytest.fixture(scope="module")
def kernel():
    """The compiled CPU kernel module (both gmc ops' CPU implementations), or a skip naming why not."""
    from gmc.kernels import cpu_group_sparse

    module = cpu_group_sparse.kernel()
    if module is None:
        pytest.skip(f"CPU kernel not compiled: {cpu_group_sparse.backend()}")
    return module


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)``: wraps ``module.name`` so each call appends 1 to the returned list."""
    def count(module, name):
        calls, function = [], getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args: calls.append(1) or function(*args))
        return calls
    return count
