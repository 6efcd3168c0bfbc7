"""The compiled CPU kernel is imported only from a private build directory (issue 14, item 5): a
library planted where another user could write is never loaded; gmc warns and runs the torch path."""
import os
import stat

import pytest

from gmc.kernels import cpu_group_sparse


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
