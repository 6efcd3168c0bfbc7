"""Model references: resolved without loading, a bad path one clear error."""
import pytest

from gmc.errors import GmcError
from gmc.runtime.refs import resolve_ref


def test_resolve_ref_kinds(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(GmcError, match="not a model"):
        resolve_ref(str(tmp_path / "empty"))
    with pytest.raises(GmcError, match="not found"):
        resolve_ref(str(tmp_path / "missing"))
    assert resolve_ref("smollm2-135m").kind == "dense"
    assert resolve_ref("org/model").kind == "dense"  # a hub id: the loader decides


def test_a_masks_artifact_names_its_base_and_a_bad_manifest_is_one_error(tmp_path):
    artifact = tmp_path / "masks"
    artifact.mkdir()
    (artifact / "masks.safetensors").write_bytes(b"")  # resolving reads the manifest alone
    (artifact / "manifest.json").write_text('{"model": "smollm2-135m"}')
    ref = resolve_ref(str(artifact))
    assert (ref.kind, ref.base) == ("masks", "smollm2-135m")
    assert resolve_ref(str(artifact), model=str(tmp_path)).base == str(tmp_path.resolve())
    (artifact / "manifest.json").write_text("[1, 2]")
    with pytest.raises(GmcError, match="holds a JSON list"):
        resolve_ref(str(artifact))
