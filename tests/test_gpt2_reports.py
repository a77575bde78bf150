"""The benchmark reports (tables and plots) on synthetic rows: every column present, files written."""

import dataclasses
import json

import pytest

from gpt2_bench import compare, compare_layout, compare_paper, compare_rows
from gpt2_bench.compare_rows import Row
from gpt2_bench.config import TrainConfig


def _summary(algorithm, compressed, iter_ms, **extra):
    """A run's summary as :func:`gpt2_bench.launch.summarise` gives it (the fields the reports read)."""
    return {"algorithm": algorithm, "compressed": compressed, "iter_ms": iter_ms, "train_s": iter_ms * 0.06,
            "exchange_ms_per_mb": 7.0, "wire_bytes_per_rank": 12 * 2**20, "val_loss": 7.5, "peel_success": None
            if algorithm == "fsdp" else 1.0, "curve": [{"step": 0, "loss": 10.0, "elapsed_s": 1.0}], **extra}


def _row(algorithm, compressed, iter_ms, **extra):
    method = "fsdp" if algorithm == "fsdp" else f"{algorithm}-{compressed}"
    return Row.from_summary(_summary(algorithm, compressed, iter_ms, **extra), method=method)


def test_compare_table_has_a_row_per_paper_row_and_both_speedups(tmp_path):
    plain, tagc = _row("fsdp", "all", 4000), _row("tagc", "non-attn", 3200)
    rows = [plain, tagc, dataclasses.replace(plain, compressed="non-attn"), dataclasses.replace(tagc)]
    for row in rows:
        row.speedup = 4000 / row.iter_ms
        row.speedup_total = plain.train_s / row.train_s
        row.val_loss_delta = 0.0
    table = compare_paper.format_table(rows, {"rate": "500mbit", "slowdown": 20, "exchange_share": 0.31})
    lines = [line for line in table.splitlines() if line.startswith(("| fsdp", "| tagc"))]
    assert len(lines) == 4 and "1.25x" in lines[1] and "25.2" in lines[2]  # ours beside the paper's
    assert all("| - |" in line for line in lines)  # no bytes model without per-step wire bytes
    compare_paper.plot(rows, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_blocks_hidden_is_the_share_of_the_blocks_wire_time_not_waited_for():
    units = {"h.1": {"wire_ms": 100, "exposed_ms": 0, "bytes": 1},
             "h.0": {"wire_ms": 130, "exposed_ms": 30, "bytes": 1},
             "<root>": {"wire_ms": 210, "exposed_ms": 200, "bytes": 2}}
    plain = _row("fsdp", "all", 720, units=units, wire_ms=440, exposed_ms=230)
    assert compare_paper.block_hidden(plain) == 1 - 30 / 230  # the root unit (the embedding's) is left out


def test_bytes_model_subtracts_the_bytes_saved_at_the_link_rate():
    # 40 MB fewer per step over 320 Mbit/s (40 MB/s) saves one second of a 4 s step
    assert compare_rows.bytes_model_ms(4000.0, 50e6, 10e6, 320 * 10**6) == 3000.0
    assert compare_rows.bytes_model_ms(4000.0, 50e6, 50e6, 320 * 10**6) == 4000.0
    assert compare_rows.bytes_model_ms(4000.0, 50e6, 10e6, None) is None  # unshaped: no link to model
    # plain run without the fair transport's counts
    assert compare_rows.bytes_model_ms(4000.0, None, 10e6, 10**9) is None


def _method_row(method, iter_ms, val_loss, wire, codec_ms=0.0, share=0.31):
    algorithm = "fsdp" if method.startswith("fsdp") else method.split("-")[0]
    return Row(method=method, algorithm=algorithm, compressed="all", iter_ms=iter_ms, val_loss=val_loss,
               wire_bytes_per_step=wire, n_params=1_000_000, codec_ms=codec_ms, exposed_ms=10.0, share=share,
               steps=20, curve=[{"step": 0, "loss": 10.0, "elapsed_s": 1.0},
                                {"step": 9, "loss": 8.0, "elapsed_s": 9.0, "val_loss": val_loss}])


def test_methods_table_sets_each_method_against_fsdp_and_fsdp_bf16():
    rows = [_method_row("fsdp", 4000, 6.00, 2_000_000), _method_row("fsdp-bf16", 3000, 6.01, 1_000_000),
            _method_row("int4", 2500, 6.10, 250_000, codec_ms=50),
            _method_row("topk", 2600, 6.02, 200_000, codec_ms=100),
            _method_row("tagc-non-attn", 2900, 6.03, 500_000, codec_ms=300)]
    compare_rows.add_method_columns(rows, rate_bps=8 * 10**6)  # 1 MB/s: a byte saved is a microsecond
    by = {row.method: row for row in rows}
    assert by["fsdp"].bits_per_param == 16.0 and by["int4"].bits_per_param == 2.0
    assert by["topk"].speedup == 4000 / 2600 and by["topk"].speedup_vs_fsdp_bf16 == 3000 / 2600
    assert by["tagc-non-attn"].bytes_model_ms == 4000 - 1500 and abs(by["int4"].val_loss_delta - 0.1 / 6) < 1e-12
    table = compare_layout.format_methods_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| int4 | all | 2500 | 1.60x | 1.20x |" in table


def test_method_names_are_checked_and_expand():
    from gpt2_bench.methods import METHODS, PAPER_METHODS, parse_methods

    assert parse_methods("peers") == tuple(METHODS) and parse_methods("paper") == PAPER_METHODS
    assert parse_methods("fsdp, int4,fsdp") == ("fsdp", "int4")
    with pytest.raises(ValueError, match="unknown method 'zip'.*fsdp-bf16"):
        parse_methods("fsdp,zip")


@pytest.mark.slow
def test_methods_compare_runs_end_to_end_on_the_tiny_preset(tmp_path):
    """Two methods, one round, unshaped: rows with every JSON column, and the report."""
    from tests.test_gpt2_train import bbc_ready

    if not bbc_ready():
        pytest.skip("offline assets missing")
    rows_path = tmp_path / "rows.json"
    compare.main(["--preset", "tiny", "--methods", "fsdp,int4", "--steps", "4", "--rounds", "1", "--link", "none",
                  "--block-size", "32", "--eval-interval", "2", "--min-compress-numel", "2048",
                  "--out-dir", str(tmp_path),
                  "--json", str(rows_path)])
    rows = json.loads(rows_path.read_text())
    assert [row["method"] for row in rows] == ["fsdp", "int4"]
    for row in rows:
        for column in ("method", "algorithm", "compressed", "wire_bytes_per_step", "bits_per_param", "speedup",
                       "speedup_vs_fsdp_bf16", "bytes_model", "val_loss", "val_loss_delta"):
            assert column in row
    assert rows[0]["bits_per_param"] == pytest.approx(16.0, rel=1e-3) and rows[1]["bits_per_param"] < 4.5
    assert (tmp_path / "methods.md").read_text().count("| int4 |") == 1


def test_rows_round_trip_through_json():
    """``--json`` writes a row's fields and the summary's other fields flat (no curve, no per-step times);
    reading it back gives the same row."""
    row = _row("tagc", "all", 3000, n_params=1000, wire_bytes_per_step=500.0, steady_iter_ms=[2990.0, 3010.0],
               integration="fsdp2", log="/tmp/x.jsonl")
    row.speedup, row.bytes_model, row.val_loss_delta, row.share = 4000 / 3000, 1.2, 0.003, 0.31
    written = json.loads(json.dumps(row.to_json()))
    assert "curve" not in written and "steady_iter_ms" not in written and "extra" not in written
    assert written["integration"] == "fsdp2" and written["bytes_model"] == 1.2 and written["method"] == "tagc-all"
    again = Row.from_json(written)
    assert again == dataclasses.replace(row, curve=[], steady_iter_ms=None)
    with pytest.raises(ValueError, match="needs algorithm, compressed"):
        Row.from_json({"method": "fsdp", "iter_ms": 1.0, "val_loss": 6.0})


def test_the_main_job_works_out_its_figures_and_its_json_reads_back(tmp_path, monkeypatch):
    """The main job on faked runs: the plain row twice (the paper's layout), then the non-overlapped
    plain row; every figure set from the plain run's numbers, and the rows' JSON reads back as the rows."""
    step_ms = {("none", True): 4000.0, ("all", True): 3000.0, ("non-attn", True): 3200.0, ("none", False): 4400.0}
    wire = {"none": 8e6, "all": 2e6, "non-attn": 3e6}

    def fake_run(cfg, data_dir, link, attempts):
        ms = step_ms[(cfg.compression, cfg.overlap)]
        return {"algorithm": "fsdp" if cfg.compression == "none" else cfg.codec, "compressed": cfg.compression,
                "iter_ms": ms, "steady_iter_ms": [ms], "train_s": ms / 100, "exchange_ms_per_mb": 7.0,
                "wire_bytes_per_rank": wire[cfg.compression], "wire_bytes_per_step": wire[cfg.compression],
                "val_loss": {"none": 6.0, "all": 6.3, "non-attn": 6.06}[cfg.compression], "n_params": 10**6,
                "grad_mb": 4.0, "peel_success": None, "units": None, "curve": [],
                "integration": cfg.integration}

    monkeypatch.setattr(compare_paper, "run", fake_run)
    monkeypatch.setattr(compare_paper, "scaled_link", lambda *a, **k: {"rate": "80mbit", "slowdown": 125.0,
                                                                        "exchange_share": 0.31})
    monkeypatch.setattr("gpt2_bench.data.prepare", lambda *a, **k: tmp_path)
    base = TrainConfig(preset="tiny", link="scaled", out_dir=str(tmp_path))
    rows, link_info = compare_paper.compare(base)
    assert [(r.method, r.algorithm, r.compressed) for r in rows] == [
        ("fsdp", "fsdp", "all"), ("tagc-all", "tagc", "all"), ("fsdp", "fsdp", "non-attn"),
        ("tagc-non-attn", "tagc", "non-attn"), ("fsdp-no-overlap", "fsdp no-overlap", "-")]
    by = {r.method: r for r in rows}
    assert by["tagc-all"].speedup == 4000 / 3000 and by["fsdp-no-overlap"].speedup == 4000 / 4400
    assert by["tagc-non-attn"].speedup_total == 40.0 / 32.0
    assert by["tagc-all"].val_loss_delta == pytest.approx(0.05) and by["fsdp"].val_loss_delta == 0.0
    assert by["tagc-all"].bits_per_param == 16.0 and by["fsdp"].bits_per_param == 64.0
    # 80 Mbit/s is 10 MB/s: 6 MB fewer per step save 600 ms of plain's 4000, 5 MB 500 ms
    assert by["tagc-all"].bytes_model_ms == pytest.approx(3400) and by["tagc-all"].bytes_model == pytest.approx(4 / 3.4)
    assert by["tagc-non-attn"].bytes_model_ms == pytest.approx(3500) and by["fsdp"].bytes_model == 1.0
    assert link_info["measured_share"] == 7.0 * 4.0 / 4400
    assert rows[0] is not rows[2] and rows[0].compressed == "all"  # the plain row twice, as two rows

    compare_rows.write_rows(rows, tmp_path / "rows.json")
    back = [Row.from_json(r) for r in json.loads((tmp_path / "rows.json").read_text())]
    assert back == [dataclasses.replace(r, curve=[], steady_iter_ms=None) for r in rows]
