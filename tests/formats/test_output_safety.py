"""Outputs never destroy what gmc did not write: existing paths refused
unless gmc's own of the same kind with --overwrite, inputs never replaced, one normalised path,
umask-honouring and fsynced atomic writes, temporaries of dead processes cleaned."""
import hashlib
import json
import os
import shutil
import stat
import subprocess

import pytest
import torch
from conftest import invoke_gmc, run_gmc
from safetensors.torch import save_file

from gmc.errors import GmcError
from gmc.formats.atomic import atomic_dir, atomic_write_bytes
from gmc.formats.outputs import MARKER, check_output, output_path
from gmc.masks.checkpoint import checkpoint_path
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig


def tree(path) -> dict:
    """Every file's bytes digest and every directory under ``path`` (to prove nothing changed)."""
    state = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            state[os.path.relpath(os.path.join(root, name), path)] = "dir"
        for name in files:
            full = os.path.join(root, name)
            state[os.path.relpath(full, path)] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return state


def test_existing_paths_are_refused_unless_gmc_wrote_them_and_overwrite_is_given(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    notes = tmp_path / "notes.txt"
    notes.write_text("notes")
    for path in (mine, notes):
        for overwrite in (False, True):
            with pytest.raises(GmcError, match="gmc did not write"):
                check_output(path, "masks", overwrite=overwrite)
    report = tmp_path / "report"
    with atomic_dir(report, "report") as tmp:
        (tmp / "report.json").write_text("{}")
    with pytest.raises(GmcError, match="holds a report of gmc"):
        check_output(report, "masks", overwrite=True)  # another kind, even with --overwrite
    with pytest.raises(GmcError, match="pass --overwrite to replace it"):
        check_output(report, "report")
    assert check_output(str(report) + "/", "report", overwrite=True) == report
    link = tmp_path / "link"
    link.symlink_to(report)
    with pytest.raises(GmcError, match="symbolic link"):
        check_output(link, "report", overwrite=True)


def test_an_output_never_equals_or_contains_an_input(tmp_path):
    model = tmp_path / "runs" / "model"
    model.mkdir(parents=True)
    for out in (model, tmp_path / "runs", str(model) + "/"):
        with pytest.raises(GmcError, match="would replace"):
            check_output(out, "masks", inputs=[model], overwrite=True)
    assert check_output(model / "report", "report", inputs=[model]) == model / "report"  # inside is fine
    check_output(tmp_path / "out", "masks", inputs=["org/name", "smollm2-135m", None])  # not local paths


def test_unwritable_outputs_are_refused_before_any_work(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out in (a_file / "out", a_file / "deep" / "out"):
        with pytest.raises(GmcError, match="is a file, not a directory"):
            check_output(out, "masks")
    if os.getuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(GmcError, match="not writable"):
            check_output(locked / "out", "masks")


def test_output_paths_are_normalised_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert output_path("out/") == output_path("out") == output_path("./x/../out") == tmp_path / "out"
    for spelling in ("out/", "out", str(tmp_path / "out") + "/"):
        config = PruneConfig(model="m", output=spelling, calib="bundled", learn=LearnConfig(progress=False))
        assert checkpoint_path(config.output, config.learn.checkpoint_dir) == tmp_path / "out.ckpt"
    config = PruneConfig(model="m", output="out", learn=LearnConfig(checkpoint_dir="ck/"))
    assert checkpoint_path(config.output, config.learn.checkpoint_dir) == tmp_path / "ck"


def test_atomic_writes_honour_umask_fsync_and_clean_dead_temporaries(tmp_path, monkeypatch):
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, alive = finished.pid, os.getppid()
    stale = [tmp_path / f".out.tmp-{dead}-abcd1234", tmp_path / f".out.old-{dead}"]
    kept = [tmp_path / f".out.tmp-{alive}-abcd1234", tmp_path / f".other.tmp-{dead}-abcd1234"]
    for path in stale + kept:
        path.mkdir()
        (path / "half").write_text("x")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    previous = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out", "report") as tmp:
            (tmp / "report.json").write_text("{}")
            save_file({"x": torch.zeros(2)}, tmp / "masks.safetensors")  # safetensors writes it 0600
            (tmp / "lib.so").write_bytes(b"")
            (tmp / "lib.so").chmod(0o700)
        atomic_write_bytes(tmp_path / "results.json", b"{}")
    finally:
        os.umask(previous)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755  # not mkdtemp's 0700
    assert stat.S_IMODE((tmp_path / "out" / "masks.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "out" / "lib.so").stat().st_mode) == 0o755  # still executable
    assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == 0o644  # not mkstemp's 0600
    assert json.loads((tmp_path / "out" / MARKER).read_text())["kind"] == "report"
    assert len(synced) >= 7  # four files, the directory, its parent (twice)


@pytest.mark.slow
def test_cli_refuses_to_replace_what_it_did_not_write(tiny_model_dir, tmp_path):
    runs = tmp_path / "runs"
    mine = runs / "mine"
    mine.mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (runs / "notes.txt").write_text("notes")
    prune = ["prune", tiny_model_dir, "--method", "magnitude", "--group", "1x64", "--quiet"]
    refused = [
        (prune + ["-o", mine], "gmc did not write"),
        (prune + ["-o", mine, "--overwrite"], "gmc did not write"),
        (prune + ["-o", tiny_model_dir, "--overwrite"], "would replace"),
        (prune + ["-o", runs / "notes.txt"], "gmc did not write"),
        (prune + ["-o", runs / "notes.txt" / "out"], "is a file"),
        (prune + ["-o", runs / "m", "--save-dense", runs / "m"], "would replace"),
        (prune + ["-o", runs / "m" / "masks", "--save-dense", runs / "m"], "would replace"),
    ]
    before, model_before = tree(runs), tree(tiny_model_dir)
    first = run_gmc(*refused[0][0])  # one as a user's child process; the rest in process (same handler)
    assert first.returncode == 2 and refused[0][1] in first.stderr, first.stderr
    assert "Traceback" not in first.stderr and len(first.stderr.strip().splitlines()) == 1
    for args, message in refused:
        result = invoke_gmc(*args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
        assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
        assert tree(runs) == before and tree(tiny_model_dir) == model_before, args

    out = runs / "mag"
    assert invoke_gmc(*prune, "-o", out).exit_code == 0
    again = invoke_gmc(*prune, "-o", out)
    assert again.exit_code == 2 and "pass --overwrite to replace it" in again.stderr
    replaced = invoke_gmc(*prune, "-o", str(out) + "/", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    artifact = tree(out)
    for args in (["report", out, "-o", out, "--overwrite"], ["lower", out, "-o", out, "--overwrite"],
                 ["lower", out, "-o", runs, "--overwrite"], ["report", out, "-o", out / "manifest.json"],
                 ["eval", out, "--ppl", "bundled-heldout", "-o", out / "manifest.json", "--overwrite"]):
        result = invoke_gmc(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, result.output)
        assert tree(out) == artifact, args


@pytest.mark.slow
def test_manifest_names_the_model_by_absolute_path_and_model_overrides_it(tiny_model_dir, tmp_path, monkeypatch):
    from gmc.runtime.refs import resolve_ref

    work = tmp_path / "work"
    shutil.copytree(tiny_model_dir, work / "model")
    result = run_gmc("prune", "model", "--method", "magnitude", "--group", "1x64", "--quiet", "-o", "out", cwd=work)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    assert manifest["model"] == str((work / "model").resolve())
    (work / "model").rename(work / "moved")
    monkeypatch.chdir(work)  # the prune above as a user's child process; the rest in process (same handler)
    lost = invoke_gmc("lower", "out", "-o", "packed")
    assert lost.exit_code == 2 and "Traceback" not in lost.output
    lowered = invoke_gmc("lower", "out", "-o", "packed", "--model", "moved")
    assert lowered.exit_code == 0, lowered.output
    assert resolve_ref(str(work / "out"), model=str(work / "moved")).base == str((work / "moved").resolve())
