"""The compare's main job: plain FSDP against TAGC on all layers and on the non-attention layers,
beside the TAGC paper's table (``python -m gpt2_bench.compare`` with no mode flag). TAGC runs on the paper's
wire (:data:`gpt2_bench.methods.PAPER_WIRE`) except where a flag says otherwise.

It trains the same model on the same tokens with the same seed three times over the same
emulated link, times the plain run again without overlap (to show what overlap buys and to keep
the link's calibration), and writes the table, loss-vs-step and loss-vs-time plots and a Markdown report.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from gpt2_bench.compare_rows import RUN_ATTEMPTS, Row, add_method_columns, fmt, write_rows
from gpt2_bench.config import TrainConfig
from gpt2_bench.launch import run, scaled_link
from gpt2_bench.methods import on_the_papers_wire
from testbed.link import parse_rate
from testbed.paper import TABLE as PAPER


def compare(base: TrainConfig) -> tuple[list[Row], dict]:
    """Run the three trainings on one link; returns (rows, link info)."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare(base.dataset, base.cache_dir))
    link_info = {"rate": base.link}
    if base.link == "scaled":
        link_info = scaled_link(base, data_dir)
    runs = {}
    for compression in ("none", "all", "non-attn"):
        paper = on_the_papers_wire(base) if compression != "none" else {}
        cfg = base.copy_with(compression=compression, name=None, **paper)
        summary = run(cfg, data_dir, link=link_info["rate"], attempts=RUN_ATTEMPTS)
        runs[compression] = Row.from_summary(summary, method="fsdp" if compression == "none" else f"tagc-{compression}")
    plain = runs["none"]
    serial = plain
    if base.overlap:
        summary = run(base.copy_with(compression="none", name=None, overlap=False), data_dir,
                      link=link_info["rate"], attempts=RUN_ATTEMPTS)
        serial = Row.from_summary(summary, method="fsdp-no-overlap")
    if serial.exchange_ms_per_mb is not None:  # the calibration's definition: share of a non-overlapped step
        link_info["measured_share"] = serial.exchange_ms_per_mb * serial.grad_mb / serial.iter_ms
    rows = []
    for compressed in ("all", "non-attn"):  # the paper's layout: one plain row per setting
        rows.append(dataclasses.replace(plain, compressed=compressed))
        rows.append(runs[compressed])
    if serial is not plain:
        rows.append(dataclasses.replace(serial, algorithm="fsdp no-overlap", compressed="-"))
    add_method_columns(rows, parse_rate(link_info["rate"]))  # against the plain row (method fsdp)
    for row in rows:
        row.speedup_total = plain.train_s / row.train_s
    return rows, link_info


def block_hidden(row: Row) -> float | None:
    """The share of the block units' exchange time hidden behind other work (1 - exposed / wire)."""
    blocks = [u for name, u in (row.units or {}).items() if name != "<root>"]
    wire = sum(u["wire_ms"] for u in blocks)
    return None if not blocks or wire <= 0 else 1 - sum(u["exposed_ms"] for u in blocks) / wire


def format_table(rows: list[Row], link_info: dict) -> str:
    """The main job's rows beside the paper's (its iteration and exchange ms/MB), with the link's calibration."""
    scaled = (f" per rank (scaled: 10gbit / {link_info['slowdown']:.0f}, so the plain exchange takes the paper's "
              f"{link_info['exchange_share']:.0%} of a step)" if "slowdown" in link_info else "")
    measured = (f"; in the plain run it took {link_info['measured_share']:.0%}" if "measured_share" in link_info
                else "")
    lines = [f"link: {link_info['rate']}{scaled}{measured}", "",
             "| algorithm | compressed | iter ms | speed-up | bytes model | total s | speed-up (total) | exchange "
             "ms/MB | wire ms | exposed ms | blocks hidden | wire MiB/rank/step | val loss | vs fsdp | peel | paper "
             "iter | paper ms/MB |", "|---|---|" + "---:|" * 15]
    for row, paper in zip(rows, PAPER + [{"iter": "-", "exchange_ms_per_mb": "-"}]):
        hidden, peel, model = block_hidden(row), row.peel_success, row.bytes_model
        wire = row.wire_bytes_per_step or row.wire_bytes_per_rank  # a steady step's, where logged
        lines.append(
            f"| {row.algorithm} | {row.compressed} | {row.iter_ms:.0f} | {row.speedup:.2f}x | "
            f"{'-' if model is None else f'{model:.2f}x'} | {row.train_s:.1f} | {row.speedup_total:.2f}x | "
            f"{row.exchange_ms_per_mb:.2f} | {fmt(row.wire_ms, '.0f')} | {fmt(row.exposed_ms, '.0f')} | "
            f"{'-' if hidden is None else f'{hidden:.0%}'} | {wire / 2**20:.2f} | {row.val_loss:.4f} | "
            f"{100 * row.val_loss_delta:+.2f}% | {'-' if peel is None else f'{100 * peel:.2f}%'} | {paper['iter']} | "
            f"{paper['exchange_ms_per_mb']} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Training loss against step and against wall time, one line per distinct run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    runs: dict[str, Row] = {}
    for row in rows:
        runs.setdefault(row.method, row)  # each distinct run once
    for label, row in runs.items():
        curve = row.curve
        by_step.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=label)
        by_time.plot([c["elapsed_s"] for c in curve], [c["loss"] for c in curve], label=label)
    by_step.set(xlabel="step", ylabel="training loss", title="loss vs step")
    by_time.set(xlabel="wall time (s)", ylabel="training loss", title="loss vs time")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paper_report(base: TrainConfig, rows: list[Row], link_info: dict) -> str:
    """The main job's Markdown report: the table and what its columns mean."""
    table = format_table(rows, link_info)
    return (
        "# GPT-2: FSDP vs TAGC\n\n"
        f"Model preset `{base.preset}`, {base.world} ranks, {base.steps} steps of {base.batch_size}x"
        f"{base.block_size or 'preset'} tokens per rank, integration `{base.integration}`, ratio {base.ratio:g}, "
        f"{base.index_bits}-bit index, TAGC dense for the first {base.dense_steps} steps, seed {base.seed}.\n\n"
        f"{table}\n\n`speed-up` compares median step times; `speed-up (total)` the sum of every step, dense ones "
        f"included. `bytes model` is the speed-up a run would show if its steps differed from plain FSDP only in the "
        f"bytes they put on the link (plain step minus the bytes saved per step at the link rate): the most "
        f"compression can buy once its compute hides under the link. A measured speed-up near it is bound by bytes; "
        f"one well below it pays for compute on the critical path. `wire ms` is the time the step's exchanges were in "
        f"flight (each unit's first launch to its last byte, summed over units); `exposed ms` the time the step waited "
        f"for them; `blocks hidden` the share of the block units' wire time not waited for "
        f"({'overlapped' if base.overlap else 'not overlapped: --no-overlap'}).\n\n"
        f"The scaled link is calibrated so that the plain exchange takes the paper's share of a *non-overlapped* plain "
        f"step.\n\n![loss](loss.png)\n"
    )


def paper_main(base: TrainConfig, json_path: str | None) -> int:
    """``python -m gpt2_bench.compare`` (no mode flag): run, print the table, write the report, plots and rows."""
    rows, link_info = compare(base)
    print(format_table(rows, link_info))
    out = Path(base.out_dir)
    plot(rows, out / "loss.png")
    report = out / "report.md"
    report.write_text(paper_report(base, rows, link_info))
    if json_path:
        write_rows(rows, json_path)
    print(f"\nreport: {report}\nplot:   {out / 'loss.png'}", file=sys.stderr)
    return 0
