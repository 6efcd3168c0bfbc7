"""The in-memory API (``gmc.prune_``, ``gmc.lower_``) and what ``import gmc`` registers."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_masks, tiny_model

import gmc
from gmc.errors import GmcError
from gmc.kernels.linear import GroupSparseLinear

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_python() -> str:
    return README.read_text().split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_readme_python_example_prunes_lowers_and_saves_a_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)  # the example saves into ./smollm2-gm

    # the README's ten lines on the tiny model: the bundled text, blocks that fit it, a one-shot method
    code = (_readme_python().replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(tiny_model_dir)))
            .replace('"wikitext2", nsamples=128, seq_len=512', '"bundled", nsamples=8, seq_len=64')
            .replace('method="groupmask"', 'method="wanda"'))
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    model, masks = scope["model"], scope["masks"]
    assert scope["calib"].shape == (8, 64)
    swapped = [name for name, module in model.named_modules() if isinstance(module, GroupSparseLinear)]
    assert sorted(swapped) == sorted(masks.masks) and len(swapped) == 14
    reference = masks.apply_to(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), check_fingerprint=False)
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
        model.save_pretrained(tmp_path / "packed")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed").eval()
        assert isinstance(reloaded.get_submodule(swapped[0]), GroupSparseLinear)
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_prune_in_memory_folds_the_masks_and_refuses_missing_calibration():
    model = tiny_model("llama")
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    with pytest.raises(GmcError, match="needs calibration blocks"):
        gmc.prune_(model, gmc.PruneConfig(method="wanda", group="1x32"))
    masks = gmc.prune_(model, gmc.PruneConfig(method="magnitude", group="1x32", sparsity=0.5))
    weight = model.model.layers[0].mlp.up_proj.weight
    assert masks.manifest["method"] == "magnitude" and abs(masks.manifest["global_sparsity"] - 0.5) < 0.05
    assert torch.equal(weight == 0, (before != 0) & (weight == 0))  # pruned entries zeroed, in place
    assert 0.3 < float((weight == 0).float().mean()) < 0.7


@pytest.mark.slow
def test_import_gmc_registers_the_ops_for_torch_export_load(tmp_path):
    """A lowered program loads with plain ``torch.export.load`` in a fresh process after ``import gmc``."""
    from gmc.graph.pipeline import lower
    from gmc.graph.trace import export_logits
    from gmc.groups import GroupSpec

    model = tiny_model("llama", vocab_size=256)
    spec = GroupSpec(1, 32)
    gm, _ = lower(model, random_masks(model, spec), spec)
    program = export_logits(gm, 256)
    torch.export.save(program, tmp_path / "program.pt2")
    ids = torch.randint(0, 256, (1, 6))
    torch.save({"ids": ids, "logits": program.module()(ids)}, tmp_path / "expected.pt")
    code = ("import gmc, torch; p = torch.export.load({0!r}); e = torch.load({1!r}); "
            "torch.testing.assert_close(p.module()(e['ids']), e['logits']); print('ok')")
    result = subprocess.run([sys.executable, "-c", code.format(str(tmp_path / "program.pt2"),
                                                              str(tmp_path / "expected.pt"))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
