"""The passes are what the commands run: graphs of prune, --save-dense, lower, eval; graph and eager
forms agree bit for bit; no import cycle inside gmc/."""
import ast
import copy
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import random_masks, set_selectors, tiny_model
from transformers import AutoModelForCausalLM

from gmc.cli.main import cli
from gmc.formats.artifact import load_artifact
from gmc.graph.pipeline import LowerOptions, fold, lower, prepare
from gmc.graph.selector import GroupSelector
from gmc.graph.targets import PROJECTIONS, TargetFilter, eager_targets
from gmc.groups import parse_pattern

GMC = Path(__file__).resolve().parents[2] / "gmc"
OP = torch.ops.gmc.group_sparse_linear.default


def _ops(graph: torch.fx.Graph, target) -> int:
    return sum(node.op == "call_function" and node.target is target for node in graph.nodes)


@pytest.mark.slow
def test_prepare_inserts_one_selector_per_target_of_the_one_target_set():
    model = tiny_model("qwen3")
    gm, targets, _ = prepare(model, parse_pattern("1x16"))
    selectors = [n for n in gm.graph.nodes
                 if n.op == "call_module" and isinstance(gm.get_submodule(n.target), GroupSelector)]
    assert len(selectors) == len(targets) == 7 * model.config.num_hidden_layers
    assert sorted(t.name for t in targets) == sorted(t.name for t in eager_targets(model))  # graph = eager form
    assert _ops(gm.graph, torch.ops.aten.linear.default) == 1  # lm_head only
    chosen = TargetFilter(include=r"mlp\.", ignore="down_proj$")
    chosen_targets = prepare(model, parse_pattern("1x16"), chosen).targets
    assert {t.name.rsplit(".", 1)[1] for t in chosen_targets} == {"gate_proj", "up_proj"}
    assert PROJECTIONS[0] == "q_proj"


@pytest.mark.slow
@pytest.mark.parametrize("group", ["1x16", "8x8", "2:4"])
def test_fold_graph_and_eager_forms_give_bit_identical_logits(group):
    model = tiny_model("llama")
    pattern = parse_pattern(group)
    masks = random_masks(model, pattern) if ":" not in group else None
    if masks is None:  # N:M: a mask on the 2:4 grid
        masks = {t.name: torch.rand(pattern.grid(t.shape)).argsort(-1).argsort(-1) < 2 for t in eager_targets(model)}
    dense = copy.deepcopy(model)
    gm = fold(model, masks, pattern, in_place=True)
    assert not any(isinstance(m, GroupSelector) for m in gm.modules())
    assert _ops(gm.graph, torch.ops.aten.linear.default) == 1 + len(masks)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(gm(ids), model(ids).logits)  # the eager form holds the same folded weights
        for name, mask in masks.items():
            weight = model.get_submodule(name).weight
            assert torch.equal(weight, dense.get_submodule(name).weight * pattern.expand(mask.float(), weight.shape))


def test_lowered_graph_has_one_op_per_target_and_matches_the_eager_form():
    from gmc.kernels.linear import GroupSparseLinear, swap_group_sparse_linears

    model = tiny_model("llama", hidden_size=80, intermediate_size=144)  # ragged 1x32 blocks
    pattern = parse_pattern("1x32")
    masks = random_masks(model, pattern)
    gm, packed = lower(model, masks, pattern, options=LowerOptions(head=False, fuse=False))
    assert _ops(gm.graph, OP) == len(masks) and _ops(gm.graph, torch.ops.aten.linear.default) == 1
    assert not any(name.endswith(("q_proj.weight", "down_proj.weight")) for name, _ in gm.named_parameters())
    eager = swap_group_sparse_linears(copy.deepcopy(model), packed)
    assert sum(isinstance(m, GroupSparseLinear) for m in eager.modules()) == len(masks)
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        expected = eager(ids, use_cache=False).logits
        assert torch.equal(gm(ids), expected)
        fused, _ = lower(model, masks, pattern)  # the default list: head lowered, siblings and MLPs fused
        assert _ops(fused.graph, torch.ops.aten.linear.default) == 0
        torch.testing.assert_close(fused(ids), expected, atol=1e-5, rtol=1e-5)


def test_eager_selectors_of_the_distributed_path_match_the_graph_bit_for_bit():
    """FSDP2 cannot shard the flat graph: its eager form (the same target set, the same GroupSelector
    attached to each nn.Linear) must compute what the graph computes, masks on and off."""
    from gmc.graph.selector import attach_selectors, masks_disabled

    pattern = parse_pattern("1x16")
    graph_model, eager_model = tiny_model("qwen3"), tiny_model("qwen3")
    masks = {name: mask.float() for name, mask in random_masks(graph_model, pattern).items()}
    gm = prepare(graph_model, pattern).gm
    set_selectors(gm, masks)
    selectors = attach_selectors(eager_model, eager_targets(eager_model), pattern)
    for name, selector in selectors.items():
        selector.selectors = masks[name]
    ids = torch.randint(0, graph_model.config.vocab_size, (2, 10))
    with torch.no_grad():
        assert torch.equal(gm(ids), eager_model(ids, use_cache=False).logits)
        with masks_disabled(gm), masks_disabled(eager_model):
            assert torch.equal(gm(ids), eager_model(ids, use_cache=False).logits)


def _artifact(tmp_path, model_dir, *extra):
    out = tmp_path / "art"
    result = CliRunner().invoke(cli, ["prune", str(model_dir), "--method", "magnitude", "--group", "1x64",
                                      "--quiet", "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_cli_lower_saves_the_lowered_program_and_dense_folds(tiny_model_dir, tmp_path):
    from gmc.formats.lowered import PROGRAM_FILE, load_lowered, load_program

    artifact = _artifact(tmp_path, tiny_model_dir, "--save-dense", str(tmp_path / "saved-dense"))
    result = CliRunner().invoke(cli, ["lower", str(artifact), "-o", str(tmp_path / "low")])
    assert result.exit_code == 0, result.output
    program = load_program(tmp_path / "low")
    masks = load_artifact(artifact).masks
    # the LOWER list: per layer q/k/v fused, o, one gated-MLP op (its two products); plus the lowered head
    layers = len(masks) // 7
    assert _ops(program.graph_module.graph, OP) == 2 * layers + 1
    assert _ops(program.graph_module.graph, torch.ops.gmc.group_sparse_gated_mlp.default) == layers
    eager, _ = load_lowered(tmp_path / "low")
    ids = torch.randint(0, eager.config.vocab_size, (1, 11))
    with torch.no_grad():
        # the lowered head runs on gmc's op, not MKL: equal to float tolerance, not bit for bit
        torch.testing.assert_close(program.module()(ids), eager(ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)

    result = CliRunner().invoke(cli, ["lower", str(artifact), "--backend", "dense", "-o", str(tmp_path / "dense")])
    assert result.exit_code == 0, result.output
    folded = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved-dense")  # prune --save-dense: the same fold
    for (name, a), (_, b) in zip(folded.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)

    (tmp_path / "low" / PROGRAM_FILE).write_bytes(b"not a zip")
    result = CliRunner().invoke(cli, ["lower", str(artifact), "--backend", "dense", "-o", str(tmp_path / "dense")])
    assert result.exit_code == 2 and "--overwrite" in result.output  # an existing output is never replaced unasked
    with pytest.raises(Exception, match="corrupted lowered program"):
        load_program(tmp_path / "low")


def _imports(path: Path, package: str) -> set[str]:
    """gmc modules that ``path`` imports anywhere (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(package))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package) and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_import_cycle_inside_gmc():
    modules = {".".join(p.relative_to(GMC.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in GMC.rglob("*.py")}
    graph = {name: {m for m in _imports(path, "gmc") if m in modules and m != name and m != "gmc"}
             for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(name, stack):
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(other):] + [other]))
            if other not in state:
                visit(other, stack + [other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_load_program_refuses_pickled_payloads_unrun(tmp_path):
    import json
    import zipfile

    from gmc.errors import GmcError
    from gmc.formats.lowered import PROGRAM_FILE, load_program

    config = {"config": {"model.w": {"path_name": "weight_0", "use_pickle": True}}}
    with zipfile.ZipFile(tmp_path / PROGRAM_FILE, "w") as archive:
        archive.writestr("program/data/weights/model_weights_config.json", json.dumps(config))
    with pytest.raises(GmcError, match="pickled payloads"):
        load_program(tmp_path)
