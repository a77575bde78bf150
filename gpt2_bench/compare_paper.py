"""The compare's main job: plain FSDP against TAGC on all layers and on the non-attention layers,
beside the TAGC paper's table (``python -m gpt2_bench.compare`` with no mode flag). TAGC runs on the paper's
wire (:data:`gpt2_bench.methods.PAPER_WIRE`) except where a flag says otherwise.

It trains the same model on the same tokens with the same seed three times over the same
emulated link, times the plain run again without overlap (to show what overlap buys and to keep
the link's calibration), and writes the table, loss-vs-step and loss-vs-time plots, a timeline of
one steady step and a Markdown report.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from gpt2_bench.compare_figures import bits_per_param, bytes_model_ms
from gpt2_bench.compare_rows import Row, write_rows
from gpt2_bench.compare_runs import RUN_ATTEMPTS
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
    link_info["overlap"] = overlap_summary(plain, serial, base)
    rows = []
    for compressed in ("all", "non-attn"):  # the paper's layout: one plain row per setting
        rows.append(dataclasses.replace(plain, compressed=compressed))
        rows.append(runs[compressed])
    if serial is not plain:
        rows.append(dataclasses.replace(serial, algorithm="fsdp no-overlap", compressed="-"))
    rate_bps = parse_rate(link_info["rate"])
    for row in rows:
        row.speedup = plain.iter_ms / row.iter_ms
        model_ms = bytes_model_ms(plain.iter_ms, plain.wire_bytes_per_step, row.wire_bytes_per_step, rate_bps)
        row.bytes_model_ms = model_ms
        row.bytes_model = None if model_ms is None or model_ms <= 0 else plain.iter_ms / model_ms
        row.speedup_total = plain.train_s / row.train_s
        row.val_loss_delta = row.val_loss / plain.val_loss - 1
        row.bits_per_param = bits_per_param(row)
    return rows, link_info


def block_hidden(row: Row) -> float | None:
    """The share of the block units' exchange time hidden behind other work (1 - exposed / wire)."""
    blocks = [u for name, u in (row.units or {}).items() if name != "<root>"]
    wire = sum(u["wire_ms"] for u in blocks)
    return None if not blocks or wire <= 0 else 1 - sum(u["exposed_ms"] for u in blocks) / wire


def unit_byte_shares(preset: str) -> dict:
    """Shares of a preset's gradient bytes in the root unit's token embedding, its untied LM head
    (if any) and the blocks (counted on the meta device, no memory)."""
    import torch

    from gpt2_bench.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig.preset(preset))
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.transformer.h.parameters())
    wte = model.transformer.wte.weight.numel()
    head = 0 if model.lm_head.weight is model.transformer.wte.weight else model.lm_head.weight.numel()
    return {"embedding": wte / total, "lm_head": head / total, "blocks": blocks / total}


def overlap_summary(plain: Row, serial: Row, base: TrainConfig) -> dict:
    """What overlap can hide here, worked out from bytes and measured compute, beside what it did.

    Only the blocks' exchanges can hide (the root unit's gradient, with the embedding, is complete
    at the very end of backward); each hides behind the backward compute that follows its launch.
    So the ceiling is ``min(blocks' exchange time, compute after the first block's launch)``, taken
    from the non-overlapped plain run, as a share of its step.
    """
    presets = dict.fromkeys((base.preset, "gpt2-untied"))
    info: dict = {"shares": {preset: unit_byte_shares(preset) for preset in presets}}
    line = serial.timeline
    if line and serial.units:
        launches = [ev[1] for unit in line["units"] for ev in unit["events"] if ev[0] == "wire"]
        exchange_spans = sum(ev[2] - ev[1] for unit in line["units"] for ev in unit["events"] if ev[0] != "wire")
        backward_end = line["backward"][1]
        compute_after = max(0.0, backward_end - min(launches) - exchange_spans) if launches else 0.0
        blocks_wire = sum(u["wire_ms"] for name, u in serial.units.items() if name != "<root>")
        ceiling_ms = min(blocks_wire, compute_after)
        info.update(blocks_wire_ms=blocks_wire, compute_after_ms=compute_after, ceiling_ms=ceiling_ms,
                    ceiling_speedup=serial.iter_ms / max(1e-9, serial.iter_ms - ceiling_ms))
    info["measured_speedup"] = serial.iter_ms / plain.iter_ms
    info["blocks_hidden"] = block_hidden(plain)
    return info


def format_overlap(link_info: dict) -> str:
    """The report's paragraph on what overlap can hide and what it hid."""
    info = link_info.get("overlap") or {}
    lines = []
    for preset, shares in info.get("shares", {}).items():
        lines.append(f"- `{preset}`: {shares['embedding']:.0%} of the gradient bytes in the token embedding"
                     + (f", {shares['lm_head']:.0%} in the untied LM head" if shares["lm_head"] else " (tied LM head)")
                     + f", {shares['blocks']:.0%} in the blocks.")
    share = link_info.get("exchange_share")
    for preset, shares in info.get("shares", {}).items():
        if share:
            lines.append(f"- Bytes alone: a perfect overlap of the block units at share {share:.2f} hides at most "
                         f"{share:.2f} x {shares['blocks']:.2f} = {share * shares['blocks']:.1%} of a step in "
                         f"`{preset}` ({1 / (1 - share * shares['blocks']):.3f}x).")
    if "ceiling_ms" in info:
        lines.append(f"- Measured (non-overlapped plain run): the blocks' exchanges take "
                     f"{info['blocks_wire_ms']:.0f} ms of wire; the backward computes "
                     f"{info['compute_after_ms']:.0f} ms after the first block's launch, so a perfect overlap hides "
                     f"{info['ceiling_ms']:.0f} ms: ceiling {info['ceiling_speedup']:.3f}x.")
    if info.get("measured_speedup"):
        hidden = info.get("blocks_hidden")
        lines.append(f"- Overlapped plain against non-overlapped plain: {info['measured_speedup']:.3f}x"
                     + ("" if hidden is None else
                        f"; the block units' exchanges were {hidden:.0%} hidden (median step)") + ".")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_table(rows: list[Row], link_info: dict) -> str:
    """The main job's rows beside the paper's (its iteration and exchange ms/MB), with the link's calibration."""
    scaled = (f" per rank (scaled: 10gbit / {link_info['slowdown']:.0f}, so the plain exchange takes the paper's "
              f"{link_info['exchange_share']:.0%} of a step)" if "slowdown" in link_info else "")
    measured = (f"; in the plain run it took {link_info['measured_share']:.0%}" if "measured_share" in link_info
                else "")
    lines = [
        f"link: {link_info['rate']}{scaled}{measured}",
        "",
        ("| algorithm | compressed | iter ms | speed-up | bytes model | total s | speed-up (total) | exchange ms/MB | "
         "wire ms | exposed ms | blocks hidden | wire MiB/rank/step | val loss | vs fsdp | peel | paper iter | "
         "paper ms/MB |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row, paper in zip(rows, PAPER + [{"iter": "-", "exchange_ms_per_mb": "-"}]):
        hidden = block_hidden(row)
        wire = row.wire_bytes_per_step or row.wire_bytes_per_rank  # a steady step's, where logged
        peel = row.peel_success
        model = row.bytes_model
        lines.append(
            f"| {row.algorithm} | {row.compressed} | {row.iter_ms:.0f} | {row.speedup:.2f}x | "
            f"{'-' if model is None else f'{model:.2f}x'} | "
            f"{row.train_s:.1f} | {row.speedup_total:.2f}x | "
            f"{row.exchange_ms_per_mb:.2f} | {_ms(row.wire_ms)} | {_ms(row.exposed_ms)} | "
            f"{'-' if hidden is None else f'{hidden:.0%}'} | {wire / 2**20:.2f} | {row.val_loss:.4f} | "
            f"{100 * row.val_loss_delta:+.2f}% | "
            f"{'-' if peel is None else f'{100 * peel:.2f}%'} | {paper['iter']} | {paper['exchange_ms_per_mb']} |"
        )
    return "\n".join(lines)


def _label(row: Row) -> str:
    return row.algorithm if row.algorithm != "tagc" else f"tagc {row.compressed}"


def plot_timeline(rows: list[Row], path: Path) -> None:
    """One steady step of each distinct run: forward / backward / optimizer, the training thread's
    codec and wait spans, and each unit's bytes on the wire."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for row in rows:
        label = _label(row)
        if row.timeline and label not in [r[0] for r in runs]:
            runs.append((label, row.timeline))
    if not runs:
        return
    colors = {"forward": "#9ecae1", "backward": "#3182bd", "optimizer": "#756bb1", "compress": "#fd8d3c",
              "decode": "#31a354", "wait": "#de2d26", "wire": "#636363"}
    height = 1.2 + 0.32 * max(len(t["units"]) + 2 for _, t in runs) * len(runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, height), squeeze=False)
    for ax, (label, line) in zip(axes[:, 0], runs):
        lanes = ["compute", "exchange on thread"] + [u["unit"] for u in line["units"]]
        for kind in ("forward", "backward", "optimizer"):
            a, b = line[kind]
            ax.barh(0, b - a, left=a, color=colors[kind], label=kind)
        for i, unit in enumerate(line["units"]):
            for kind, a, b in unit["events"]:
                ax.barh(i + 2 if kind == "wire" else 1, max(b - a, 0.5), left=a, color=colors[kind], label=kind)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{label}: one steady step", fontsize=9)
        ax.set_xlabel("ms from the step's start")
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=7, loc="lower right")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows: list[Row], path: Path) -> None:
    """Training loss against step and against wall time, one line per distinct run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    seen = set()
    for row in rows:
        label = _label(row)
        if label in seen:
            continue
        seen.add(label)
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
    """The main job's Markdown report: the table, what its columns mean, and what overlap can hide."""
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
        f"step.\n\n## What overlap can hide here\n\n{format_overlap(link_info)}\n\n![loss](loss.png)\n\n"
        f"![timeline](timeline.png)\n"
    )


def paper_main(base: TrainConfig, json_path: str | None) -> int:
    """``python -m gpt2_bench.compare`` (no mode flag): run, print the table, write the report, plots and rows."""
    rows, link_info = compare(base)
    print(format_table(rows, link_info))
    out = Path(base.out_dir)
    plot(rows, out / "loss.png")
    plot_timeline(rows, out / "timeline.png")
    report = out / "report.md"
    report.write_text(paper_report(base, rows, link_info))
    if json_path:
        write_rows(rows, json_path)
    print(f"\nreport: {report}\nplot:   {out / 'loss.png'}", file=sys.stderr)
    return 0
