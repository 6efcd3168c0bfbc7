"""atomic_dir: a directory appears whole or not at all, and replaces only gmc's own of its kind."""
import pytest

from gmc.errors import GmcError
from gmc.formats.atomic import atomic_dir


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "out", "masks") as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_replaces_its_own_kind_only_with_overwrite(tmp_path):
    with atomic_dir(tmp_path / "out", "report") as tmp:
        (tmp / "old").write_text("old")
    with pytest.raises(GmcError, match="pass --overwrite"):
        with atomic_dir(tmp_path / "out", "report") as tmp:
            (tmp / "new").write_text("new")
    with atomic_dir(tmp_path / "out", "report", overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".gmc-output", "new"]
