"""The compare's parameter all-gather dtype (``--param-dtype``): every method that gathers parameters (flat FSDP,
HSDP) gets it alike, no DDP method does, run names keep the dtypes apart, and the rows and reports say it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gpt2_bench import compare, compare_layout
from gpt2_bench.compare_layout import format_methods_table, format_param_gather
from gpt2_bench.config import TrainConfig
from gpt2_bench.methods import LAYOUT_METHODS, METHODS, layout_config


@pytest.mark.parametrize("param_dtype", ["bf16"])
def test_every_flat_method_gets_the_param_dtype_and_a_name_of_its_own(param_dtype):
    base = TrainConfig(preset="tiny")
    gathered = dataclasses.replace(base, param_dtype=param_dtype)
    for method in METHODS:
        exact, cfg = layout_config(base, "flat", method), layout_config(gathered, "flat", method)
        assert exact.param_dtype is None and cfg.param_dtype == param_dtype, method
        assert cfg.run_name == f"{method}-param-{param_dtype}" and exact.run_name == method
        # only the gather differs: every codec setting is the method's own, as with fp32 gathers
        assert dataclasses.replace(cfg, param_dtype=None, name=None) == dataclasses.replace(exact, name=None)
    assert layout_config(gathered, "flat", "fsdp-bf16").reduce_dtype == "bf16"  # the baseline keeps its bf16 reduce


def test_layouts_pass_the_param_dtype_to_flat_and_hsdp_methods_and_never_to_ddp():
    base = TrainConfig(preset="tiny", param_dtype="bf16")
    for method in LAYOUT_METHODS["ddp"]:
        cfg = layout_config(base, "ddp", method, link="none")
        assert cfg.integration == "ddp" and cfg.param_dtype is None, method
        assert cfg.run_name == layout_config(dataclasses.replace(base, param_dtype=None), "ddp", method,
                                             link="none").run_name  # DDP runs are the same runs: the same names
        assert compare_layout.param_gather(cfg) is None
    for layout in ("flat", "hsdp"):
        names = set()
        for method in LAYOUT_METHODS[layout]:
            cfg = layout_config(base, layout, method, link="none")
            assert cfg.param_dtype == "bf16" and cfg.run_name.endswith("-param-bf16"), (layout, method)
            assert compare_layout.param_gather(cfg) == "bf16"
            names.add(cfg.run_name)
        assert len(names) == len(LAYOUT_METHODS[layout])  # no two runs share a log
    assert compare_layout.param_gather(layout_config(TrainConfig(preset="tiny"), "flat", "fsdp")) == "fp32"


def test_a_bad_param_dtype_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--param-dtype", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        TrainConfig(param_dtype="fp16")
    with pytest.raises(ValueError, match="DDP gathers no parameters"):
        TrainConfig(integration="ddp", compression="none", param_dtype="bf16")


def test_the_layout_compare_checks_every_runs_settings_before_running(monkeypatch, capsys):
    reached = []
    monkeypatch.setattr(compare_layout, "layout_report",
                        lambda base, layout, methods, flat, *rest: reached.append((base, methods, flat)) or ([], ""))
    assert compare.main(["--layout", "ddp", "--param-dtype", "bf16", "--flat-methods", "fsdp,fsdp-bf16"]) == 0
    (base, methods, flat), = reached
    assert base.param_dtype == "bf16" and flat == ("fsdp", "fsdp-bf16") and "ddp-bf16" in methods
    # torch's hooks have no residuals to diagnose: the layout compare refuses before running anything
    with pytest.raises(SystemExit):
        compare.main(["--layout", "ddp", "--diagnostics", "--methods", "ddp-bf16"])
    assert "torch_hook" in capsys.readouterr().err and len(reached) == 1


def _summary(cfg: TrainConfig) -> dict:
    return {"name": cfg.run_name, "algorithm": "fsdp", "compressed": cfg.compression, "iter_ms": 10.0,
            "steady_iter_ms": [10.0, 11.0], "val_loss": 5.0, "steps": cfg.steps}


def test_layout_rows_carry_the_param_dtype_each_run_used(monkeypatch, tmp_path):
    ran: list[TrainConfig] = []
    monkeypatch.setattr(compare_layout, "run", lambda cfg, *a, **k: ran.append(cfg) or _summary(cfg))
    base = TrainConfig(preset="tiny", param_dtype="bf16", link="100mbit", out_dir=str(tmp_path), world=2)
    rows, _ = compare_layout.time_layout(base, "ddp", ["ddp", "int4"], ["fsdp", "fsdp-bf16"], 0.9, 2, "")
    assert len(ran) == 8  # 4 methods x 2 rounds
    gathers = {(row.layout, row.method): row.param_dtype for row in rows}
    assert gathers == {("ddp", "ddp"): None, ("ddp", "int4"): None, ("flat", "fsdp"): "bf16",
                       ("flat", "fsdp-bf16"): "bf16"}
    assert {cfg.param_dtype for cfg in ran if cfg.integration == "ddp"} == {None}
    assert {cfg.param_dtype for cfg in ran if cfg.integration != "ddp"} == {"bf16"}
    table = format_methods_table([row for row in rows if row.layout == "flat"])
    assert table.splitlines()[0].endswith("| param gather |") and table.count("| bf16 |") == 2
    assert json.loads(json.dumps(rows[-1].to_json()))["param_dtype"] == rows[-1].param_dtype


def test_the_report_line_says_the_gathers_and_what_the_cpu_computes_with():
    assert format_param_gather(None, "simple").startswith("Parameter all-gathers: **fp32** for every flat-FSDP method")
    bf16 = format_param_gather("bf16", "simple", "ddp")
    assert "**bf16**" in bf16 and "DDP gathers no parameters" in bf16 and "upcasts" in bf16
    assert "`fsdp2`" in format_param_gather("bf16", "fsdp2")


@pytest.mark.slow
def test_a_tiny_compare_gathers_bf16_for_every_method(tmp_path):
    """Two methods, one round, unshaped, with bf16 gathers: each run's settings and name say so."""
    from tests.test_gpt2_train import bbc_ready

    if not bbc_ready():
        pytest.skip("offline assets missing")
    rows_path = tmp_path / "rows.json"
    compare.main(["--preset", "tiny", "--methods", "fsdp,fsdp-bf16", "--steps", "3", "--rounds", "1", "--link", "none",
                  "--block-size", "32", "--eval-interval", "3", "--param-dtype", "bf16", "--out-dir", str(tmp_path),
                  "--json", str(rows_path)])
    rows = json.loads(rows_path.read_text())
    assert [row["method"] for row in rows] == ["fsdp", "fsdp-bf16"]
    assert [row["name"] for row in rows] == ["fsdp-param-bf16", "fsdp-bf16-param-bf16"]
    for row in rows:
        assert row["val_loss"] == row["val_loss"]  # finite: the run trained
