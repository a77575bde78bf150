"""The benchmark reports (tables and plots) on synthetic rows: every column present, files written."""

from gpt2_bench import compare, integrations


def _row(algorithm, compressed, iter_ms, **extra):
    return {"algorithm": algorithm, "compressed": compressed, "iter_ms": iter_ms, "train_s": iter_ms * 0.06,
            "exchange_ms_per_mb": 7.0, "wire_bytes_per_rank": 12 * 2**20, "val_loss": 7.5, "peel_success": None
            if algorithm == "fsdp" else 1.0, "curve": [{"step": 0, "loss": 10.0, "elapsed_s": 1.0}], **extra}


def test_compare_table_has_a_row_per_paper_row_and_both_speedups(tmp_path):
    plain, tagc = _row("fsdp", "all", 4000), _row("tagc", "non-attn", 3200)
    rows = [dict(plain), dict(tagc), dict(plain, compressed="non-attn"), dict(tagc)]
    for row in rows:
        row["speedup"] = 4000 / row["iter_ms"]
        row["speedup_total"] = plain["train_s"] / row["train_s"]
        row["val_loss_vs_fsdp"] = 0.0
    table = compare.format_table(rows, {"rate": "500mbit", "slowdown": 20, "exchange_share": 0.31})
    lines = [line for line in table.splitlines() if line.startswith("| fsdp") or line.startswith("| tagc")]
    assert len(lines) == 4 and "1.25x" in lines[1] and "25.2" in lines[2]  # ours beside the paper's
    assert all("| - |" in line for line in lines)  # no bytes model without per-step wire bytes
    compare.plot(rows, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_overlap_columns_ceiling_and_timeline(tmp_path):
    line = {"forward": [0, 100], "backward": [100, 400], "optimizer": [400, 420],
            "units": [{"unit": "h.1", "events": [["wire", 150, 250]]}, {"unit": "h.0", "events": [["wire", 250, 380]]},
                      {"unit": "<root>", "events": [["wire", 390, 600], ["wait", 400, 600]]}]}
    units = {"h.1": {"wire_ms": 100, "exposed_ms": 0, "bytes": 1}, "h.0": {"wire_ms": 130, "exposed_ms": 30, "bytes": 1},
             "<root>": {"wire_ms": 210, "exposed_ms": 200, "bytes": 2}}
    serial = _row("fsdp", "-", 800, units=units, timeline=line, wire_ms=440, exposed_ms=440)
    plain = _row("fsdp", "all", 720, units=units, timeline=line, wire_ms=440, exposed_ms=230)
    assert compare.block_hidden(plain) == 1 - 30 / 230
    info = compare.overlap_summary(plain, serial, compare.TrainConfig(preset="tiny"))
    # the blocks' 230 ms of wire could hide behind the 250 ms of backward after the first launch, less 200 ms of waiting
    assert info["compute_after_ms"] == 250 - 200 and info["ceiling_ms"] == 50
    assert info["measured_speedup"] == 800 / 720 and set(info["shares"]) == {"tiny", "gpt2-untied"}
    text = compare.format_overlap({"overlap": info, "exchange_share": 0.31})
    assert "gpt2-untied" in text and "ceiling" in text and "1.111x" in text
    compare.plot_timeline([plain, serial], tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_integrations_table_and_plot(tmp_path):
    rows = []
    for label, _, _ in integrations.SETUPS:
        for algorithm in ("fsdp", "tagc"):
            rows.append(_row(algorithm, "non-attn", 2000 if algorithm == "fsdp" else 2500, setup=label,
                             vs_fsdp2_eager=1.0, peak_rss_mb=1300.0, forward_rss_mb=1000.0))
    table = integrations.format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "TAGC non-attn" in table and "plain (gloo" in table
    integrations.plot(rows, tmp_path / "integrations.png")
    assert (tmp_path / "integrations.png").stat().st_size > 0


def test_bytes_model_subtracts_the_bytes_saved_at_the_link_rate():
    # 40 MB fewer per step over 320 Mbit/s (40 MB/s) saves one second of a 4 s step
    assert compare.bytes_model_ms(4000.0, 50e6, 10e6, 320 * 10**6) == 3000.0
    assert compare.bytes_model_ms(4000.0, 50e6, 50e6, 320 * 10**6) == 4000.0
    assert compare.bytes_model_ms(4000.0, 50e6, 10e6, None) is None  # unshaped: no link to model
    assert compare.bytes_model_ms(4000.0, None, 10e6, 10**9) is None  # plain run without the fair transport's counts
