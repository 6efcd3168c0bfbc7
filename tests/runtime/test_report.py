import json

import pytest
from conftest import (
    REPORT_LAYERS,
    REPORT_SHAPES,
    additive,
    correlated,
    target_name,
    write_manifest,
)

from gmc.errors import GmcError
from gmc.runtime.report import (
    BLOCKS_PNG,
    RATES_PNG,
    ReportConfig,
    analyse,
    build_report,
    parse_target,
    target_rates,
    write_report,
)


@pytest.mark.parametrize("module, expected", [
    ("model.layers.12.self_attn.q_proj", (12, "q", "attention")),
    ("model.layers.0.mlp.down_proj", (0, "down", "mlp")),
    ("model.decoder.layers.3.self_attn.out_proj", (3, "out", "attention")),
    ("transformer.h.7.mlp.c_fc", (7, "c_fc", "mlp")),
    ("model.layers.2.block_sparse_moe.w1", (2, "w1", "other")),
])
def test_parse_target(module, expected):
    assert parse_target(module) == expected


def test_parse_target_without_layer_index():
    with pytest.raises(GmcError, match="layer index"):
        parse_target("lm_head")


def test_known_correlations_and_shares(tmp_path):
    report = build_report(ReportConfig(str(write_manifest(tmp_path / "a", correlated))))

    assert report["correlations"]["q_vs_k"] == pytest.approx(1.0)
    assert report["correlations"]["gate_vs_up"] == pytest.approx(-1.0)
    assert report["layers"] == [0, 1, 2, 3] and report["projections"] == list(REPORT_SHAPES)
    assert report["rate_by_layer"]["k"] == pytest.approx([0.4, 0.6, 0.8, 1.0])

    kept = {p: sum(REPORT_SHAPES[p][0] * REPORT_SHAPES[p][1] * correlated(layer, p) for layer in range(REPORT_LAYERS))
            for p in REPORT_SHAPES}
    params = {p: REPORT_LAYERS * REPORT_SHAPES[p][0] * REPORT_SHAPES[p][1] for p in REPORT_SHAPES}
    for proj in REPORT_SHAPES:
        stats = report["by_projection"][proj]
        assert stats["preserved_rate"] == pytest.approx(kept[proj] / params[proj])
        assert stats["preserved_share"] == pytest.approx(kept[proj] / sum(kept.values()))
        assert stats["param_share"] == pytest.approx(params[proj] / sum(params.values()))
    attention = sum(kept[p] for p in "qkvo") / sum(params[p] for p in "qkvo")
    assert report["by_block"]["attention"]["preserved_rate"] == pytest.approx(attention)
    assert report["qkv_preserved_rate"] == pytest.approx(sum(kept[p] / params[p] for p in "qkv") / 3)
    assert report["global_preserved"] == pytest.approx(sum(kept.values()) / sum(params.values()))

    # pruned beyond 0.5 sparsity = preserved below 0.5: q at layers 0, 1; k at layer 0; o at all layers
    beyond = 2 * 64 * 64 + 32 * 64 + REPORT_LAYERS * 64 * 64
    assert report["beyond_target"]["targets"] == 2 + 1 + REPORT_LAYERS
    assert report["beyond_target"]["fraction_of_params"] == pytest.approx(beyond / sum(params.values()))


def test_variance_shares_of_an_additive_layout(tmp_path):
    report = build_report(ReportConfig(str(write_manifest(tmp_path / "a", additive))))
    type_var = 0.01 * 4.0  # variance of 0.1 * (1..7)
    depth_var = 0.0025 * 1.25  # variance of 0.05 * (0..3)
    shares = report["variance_share"]
    assert shares["projection_type"] == pytest.approx(type_var / (type_var + depth_var))
    assert shares["depth"] == pytest.approx(depth_var / (type_var + depth_var))
    assert shares["interaction"] == pytest.approx(0.0, abs=1e-9)


def test_uniform_rates_have_undefined_correlations():
    rates = target_rates({"layer_sparsity": {target_name(layer, p): 0.5 for layer in range(2) for p in REPORT_SHAPES},
                          "shapes": {target_name(layer, p): REPORT_SHAPES[p]
                                     for layer in range(2) for p in REPORT_SHAPES}})
    result = analyse(rates, 0.5)
    assert result["correlations"] == {"q_vs_k": None, "gate_vs_up": None}
    assert result["variance_share"]["projection_type"] is None
    assert result["beyond_target"]["targets"] == 0


def test_write_report_outputs_and_pngs(tmp_path):
    import matplotlib.image

    artifact = write_manifest(tmp_path / "a", correlated)
    config = ReportConfig(str(artifact))
    report = write_report(config)

    out = artifact / "report"
    assert config.output == str(out)
    assert json.loads((out / "report.json").read_text())["correlations"] == report["correlations"]
    markdown = (out / "report.md").read_text()
    assert "Pearson r, Q vs K across layers: **1.000**" in markdown and RATES_PNG in markdown
    for png in (RATES_PNG, BLOCKS_PNG):
        assert (out / png).stat().st_size > 15_000
        image = matplotlib.image.imread(out / png)  # [H, W, 4] floats
        assert image.shape[0] > 400 and image.shape[1] > 800
        assert len({tuple(pixel) for pixel in image.reshape(-1, image.shape[-1])[::7].tolist()}) > 20


def test_report_config_errors(tmp_path):
    with pytest.raises(GmcError, match="no manifest.json"):
        ReportConfig(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(GmcError, match="not valid JSON"):
        build_report(ReportConfig(str(tmp_path)))
