import pytest
import torch
from conftest import tiny_model

from gmc.errors import GmcError
from gmc.graph.passes.find_targets import find_targets
from gmc.graph.trace import trace_model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_traced_graph_equals_eager_for_dynamic_shapes(arch):
    model = tiny_model(arch)
    gm = trace_model(model)
    for shape in [(1, 5), (3, 17)]:
        ids = torch.randint(0, 320, shape)
        torch.testing.assert_close(gm(ids), model(ids).logits, atol=1e-5, rtol=1e-5)
    targets = find_targets(gm)
    assert len(targets) == 7 * 2
    assert targets[0].name == "model.layers.0.self_attn.q_proj"
    assert all("lm_head" not in t.name for t in targets)


def test_graph_keeps_no_trace_time_dtype_checks():
    """Export checks each cast's input dtype as traced; under bf16 autocast on CUDA those inputs are
    bf16 and the checks raised, so the traced graph drops them (and still computes the logits)."""
    model = tiny_model("llama")
    gm = trace_model(model)
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    ids = torch.randint(0, 320, (2, 7))
    torch.testing.assert_close(gm(ids), model(ids).logits, atol=1e-5, rtol=1e-5)


def test_graph_shares_the_frozen_weights():
    model = tiny_model("llama")
    gm = trace_model(model)
    weight = gm.get_parameter("model.model.layers.0.mlp.up_proj.weight")
    assert weight.data_ptr() == model.model.layers[0].mlp.up_proj.weight.data_ptr()
    assert not any(p.requires_grad for p in gm.parameters())


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"vocab_size": 10})()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, input_ids, use_cache=False):
        hidden = self.embed(input_ids)
        if hidden.sum() > 0:  # data-dependent control flow: not exportable
            hidden = hidden * 2
        return type("Out", (), {"logits": hidden})()


def test_untraceable_model_names_its_class():
    with pytest.raises(GmcError, match=r"cannot trace _DataDependent with torch.export") as info:
        trace_model(_DataDependent())
    assert "\n" not in str(info.value)


def test_graph_records_no_stack_traces_but_keeps_module_paths():
    """Exports skip the per-node Python stack trace (a third of the export's time on SmolLM2), keep the
    module path every node was traced in (``gmc.graph.taps`` and the target passes read it), and leave
    torch's setting as they found it."""
    import torch.fx.config

    before = torch.fx.config.do_not_emit_stack_traces
    gm = trace_model(tiny_model("llama"))
    assert torch.fx.config.do_not_emit_stack_traces == before
    calls = [node for node in gm.graph.nodes if node.op == "call_function"]
    traced = [node.meta.get("stack_trace") for node in calls]
    assert calls and all(trace is None or "runtime_assert" in trace for trace in traced)  # export's own checks
    assert any("layers.0" in str(node.meta.get("nn_module_stack")) for node in calls)
