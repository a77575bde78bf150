"""The benchmark reports (tables and plots) on synthetic rows: every column present, files written."""

import dataclasses
import json

import pytest

from gpt2_bench import compare, compare_layout, compare_paper, compare_rows
from gpt2_bench.compare_rows import Loss, Row
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


def test_methods_table_names_the_fastest_method_within_one_percent_and_places_tagc(tmp_path):
    rows = [_method_row("fsdp", 4000, 6.00, 2_000_000), _method_row("fsdp-bf16", 3000, 6.01, 1_000_000),
            _method_row("int4", 2500, 6.10, 250_000, codec_ms=50),  # fastest, but 1.7% worse: not the winner
            _method_row("topk", 2600, 6.02, 200_000, codec_ms=100),
            _method_row("tagc-non-attn", 2900, 6.03, 500_000, codec_ms=300)]
    compare_rows.add_method_columns(rows, rate_bps=8 * 10**6)  # 1 MB/s: a byte saved is a microsecond
    by = {row.method: row for row in rows}
    assert by["fsdp"].bits_per_param == 16.0 and by["int4"].bits_per_param == 2.0
    assert by["topk"].speedup == 4000 / 2600 and by["topk"].speedup_vs_fsdp_bf16 == 3000 / 2600
    assert by["tagc-non-attn"].bytes_model_ms == 4000 - 1500 and abs(by["int4"].val_loss_delta - 0.1 / 6) < 1e-12
    assert compare_rows.winner(rows).method == "topk"
    gap = compare_rows.explain_gap(by["tagc-non-attn"], by["topk"])
    assert gap.startswith("+300 ms") and "bytes +300 ms" in gap and "codec +200 ms" in gap and "+0.17 points" in gap
    verdict = compare_layout.format_verdict(rows)
    assert "**topk**" in verdict and "Dominated by topk (faster" in verdict
    table = compare_layout.format_methods_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| int4 | all | 2500 | 1.60x | 1.20x |" in table
    share_rows = ([dataclasses.replace(r, share=0.31) for r in rows]
                  + [dataclasses.replace(r, share=0.9, speedup=2 * r.speedup) for r in rows])
    compare_layout.plot_pareto(share_rows, tmp_path / "pareto.png")
    compare_layout.plot_speedup_vs_share(share_rows, tmp_path / "share.png")
    assert all((tmp_path / name).stat().st_size > 0 for name in ("pareto.png", "share.png"))


def test_method_names_are_checked_and_expand():
    from gpt2_bench.methods import METHODS, PAPER_METHODS, parse_methods

    assert parse_methods("peers") == tuple(METHODS) and parse_methods("paper") == PAPER_METHODS
    assert parse_methods("fsdp, int4,fsdp") == ("fsdp", "int4")
    with pytest.raises(ValueError, match="unknown method 'zip'.*fsdp-bf16"):
        parse_methods("fsdp,zip")


@pytest.mark.slow
def test_methods_compare_runs_end_to_end_on_the_tiny_preset(tmp_path):
    """Two methods, one round, unshaped: rows with every JSON column, the report and its plots."""
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
    assert (tmp_path / "methods.md").read_text().count("| int4 |") == 1 and (tmp_path / "pareto.png").exists()


def test_losses_can_come_from_another_compares_rows(tmp_path):
    rows = tmp_path / "small.json"
    rows.write_text(json.dumps([{"method": "fsdp", "val_loss": 6.5, "val_loss_steps": 300},
                                {"method": "int4", "val_loss": 6.52, "val_loss_steps": 300}, {"method": "x"},
                                {"method": "int4", "val_loss": 6.6, "layout": "ddp"}]))
    by_layout = compare_rows.losses_from(str(rows))
    found = by_layout["flat"]
    assert set(found) == {"fsdp", "int4"} and found["int4"].val_loss == 6.52 and found["fsdp"].steps == 300
    assert by_layout["ddp"]["int4"].val_loss == 6.6  # a layout's rows stay apart from the flat ones
    timed = [Row(method="fsdp", algorithm="fsdp", compressed="none", iter_ms=100.0, n_params=10,
                 wire_bytes_per_step=80, val_loss=9.0),
             Row(method="int4", algorithm="int4", compressed="all", iter_ms=50.0, n_params=10, wire_bytes_per_step=10,
                 val_loss=9.9)]
    compare_rows.add_method_columns(timed, None, found)
    assert [r.val_loss for r in timed] == [6.5, 6.52] and timed[1].val_loss_delta == pytest.approx(0.02 / 6.5)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no rows with a method and a val_loss"):
        compare_rows.losses_from(str(tmp_path / "empty.json"))


def test_a_loss_from_a_run_of_another_length_is_shown_but_not_compared():
    """A 300-step val loss beside 2,000-step ones: no gap to fsdp, no winner, no dominance."""
    found = {"fsdp": Loss(6.13, 2000), "tagc-non-attn": Loss(6.25, 2000), "fsdp-bf16": Loss(6.84, 300),
             "int4": Loss(6.18, 2000)}
    timed = [Row(method=m, algorithm="fsdp" if m.startswith("fsdp") else "tagc", compressed="all", iter_ms=t,
                 n_params=10, wire_bytes_per_step=80, val_loss=9.0, share=0.9)
             for m, t in [("fsdp", 100.0), ("fsdp-bf16", 60.0), ("tagc-non-attn", 80.0), ("int4", 70.0)]]
    compare_rows.add_method_columns(timed, None, found)
    by = {r.method: r for r in timed}
    assert by["fsdp-bf16"].val_loss_delta is None and by["int4"].val_loss_delta == pytest.approx(0.05 / 6.13)
    assert compare_rows.winner(timed).method == "int4"  # fsdp-bf16 is faster, but its loss is not comparable
    table = compare_layout.format_methods_table(timed)
    assert "6.8400 (300 steps) | - |" in table and "6.1800 |" in table
    verdict = compare_layout.format_verdict(timed)
    assert "Dominated by int4 (" in verdict and "fsdp-bf16," not in verdict.split("Dominated by")[1]


def test_a_report_is_made_again_from_earlier_timed_rows_with_later_losses(tmp_path, monkeypatch):
    """``--timed-from`` times nothing: it takes the earlier rows (their shares, rounds and steps) and
    the losses of ``--loss-from``, so a longer run's loss can name another winner."""

    def fail(*args, **kwargs):
        raise AssertionError("--timed-from must not train or time")

    monkeypatch.setattr(compare_layout, "run", fail)
    monkeypatch.setattr(compare_layout, "time_layout", fail)
    timed = [{"method": m, "algorithm": "fsdp" if m.startswith("fsdp") else "tagc", "compressed": "all", "iter_ms": t,
              "n_params": 10, "wire_bytes_per_step": b, "val_loss": 9.0, "share": share, "link": "948mbit",
              "rounds": 2, "steps": 4, "preset": "small", "dense_steps": 1}
             for share in (0.31, 0.9) for m, t, b in [("fsdp", 100.0, 80), ("fsdp-bf16", 60.0, 40), ("int4", 70.0, 10)]]
    timed[0]["link_info"] = {"rate": "948mbit", "rate_bps": 948_000_000, "rest_ms": 4721.0, "exchange_share": 0.31,
                             "share_of": "exchange", "modelled_exchange_share": 0.31, "slowdown": 10.5,
                             "first_guess": "1.22gbit", "first_guess_share": 0.27}
    (tmp_path / "timed.json").write_text(json.dumps(timed))
    losses = [{"method": "fsdp", "val_loss": 6.13, "steps": 2000}, {"method": "int4", "val_loss": 6.18, "steps": 2000}]
    (tmp_path / "short.json").write_text(json.dumps(losses + [{"method": "fsdp-bf16", "val_loss": 6.84, "steps": 300}]))
    (tmp_path / "long.json").write_text(json.dumps(losses + [{"method": "fsdp-bf16", "val_loss": 6.15, "steps": 2000}]))
    args = ["--methods", "fsdp,fsdp-bf16,int4", "--timed-from", str(tmp_path / "timed.json")]

    def report(losses_file):
        out = tmp_path / f"out-{losses_file}"
        assert compare.main(args + ["--loss-from", str(tmp_path / losses_file), "--out-dir", str(out),
                                    "--json", str(out / "rows.json")]) == 0
        return (out / "methods.md").read_text(), json.loads((out / "rows.json").read_text())

    text, rows = report("short.json")
    assert text.count("Fastest within 1% of fsdp's val loss: **int4**") == 2 and "timed in" in text
    assert "a plain step computes 4721 ms here" in text  # share 0.31's rows carry their link's arithmetic
    assert "- share 0.9: link 948mbit; timed in" in text  # share 0.9's predate it
    assert "4 steps, 2 round(s) per share" in text.replace("timed runs of ", "")
    assert "dense for the first 1 steps" in text  # the timed rows' warm-up, not the command line's default
    text, rows = report("long.json")
    assert text.count("Fastest within 1% of fsdp's val loss: **fsdp-bf16**") == 2
    by = {(r["share"], r["method"]): r for r in rows}
    assert by[(0.9, "fsdp-bf16")]["val_loss_delta"] == pytest.approx(0.02 / 6.13)
    assert by[(0.9, "int4")]["speedup"] == pytest.approx(100 / 70) and len(rows) == 6

    for wrong in (["--methods", "fsdp,topk"], ["--preset", "gpt2-untied"], ["--shares", "0.5"]):
        with pytest.raises(SystemExit):
            compare.main(args + wrong + ["--loss-from", str(tmp_path / "long.json"), "--out-dir", str(tmp_path / "x")])


def test_rows_round_trip_through_json_and_old_alias_keys_are_read():
    """``--json`` writes a row's fields and the summary's other fields flat (no curve, no per-step times);
    reading it back gives the same row. Rows written before the records name two figures twice
    (``bytes_model_speedup``, ``val_loss_vs_fsdp``): read alone, each fills its one field."""
    row = _row("tagc", "all", 3000, n_params=1000, wire_bytes_per_step=500.0, steady_iter_ms=[2990.0, 3010.0],
               integration="fsdp2", log="/tmp/x.jsonl")
    row.speedup, row.bytes_model, row.val_loss_delta, row.share = 4000 / 3000, 1.2, 0.003, 0.31
    written = json.loads(json.dumps(row.to_json()))
    assert "curve" not in written and "steady_iter_ms" not in written and "extra" not in written
    assert written["integration"] == "fsdp2" and written["bytes_model"] == 1.2 and written["method"] == "tagc-all"
    again = Row.from_json(written)
    assert again == dataclasses.replace(row, curve=[], steady_iter_ms=None)

    old = {k: v for k, v in written.items() if k not in ("bytes_model", "val_loss_delta")}
    old.update(bytes_model_speedup=1.5, val_loss_vs_fsdp=-0.002)
    read = Row.from_json(old)
    assert (read.bytes_model, read.val_loss_delta) == (1.5, -0.002) and "bytes_model_speedup" not in read.extra
    both = Row.from_json({**written, "bytes_model_speedup": 9.9})  # the field's own key wins over its alias
    assert both.bytes_model == 1.2
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
