"""Plain FSDP against TAGC, all layers against non-attention layers, side by side in one run.

``python -m gpt2_bench.compare`` trains the same model on the same tokens with the same seed
three times — uncompressed FSDP (the fair all-to-all reduce-scatter), TAGC on all layers and
TAGC on the non-attention linear layers — over the same emulated link, then prints the TAGC
paper's table beside ours, writes ``--json`` rows, loss-vs-step and loss-vs-time plots, a
timeline of one step and a Markdown report.

Every run overlaps each unit's exchange with the backward of the units before it (the
default); the plain run is also timed without overlap (``fsdp no-overlap``) to show what
overlap buys and to keep the link's calibration (the plain exchange's share of a
non-overlapped plain step). ``--no-overlap`` runs everything the old, blocking way.

Quality runs (``--quality-steps``, ``--quality-only``) measure each method's val loss unshaped.
For a decision, run them over seeds (``--seeds 0,1``): the report (:mod:`gpt2_bench.quality`)
gives every method's mean gap to fsdp of the same seed and the seed-to-seed spread at each
evaluation, and calls a gap inside the spread a tie. On ``--dataset mix`` a 2,000-step run reads
no token twice. The point at 4x the tokens per step is ``--batch-size 16`` (4x the default 4
windows per rank; one exchange per step, as a 4x larger global batch). ``--diagnostics`` logs the
per-step diagnostics of every run (:mod:`gpt2_bench.diagnostics`). A screening run is one seed
(``--seed``), resumed from its checkpoints like any quality run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from gpt2_bench.methods import METHODS, PAPER_METHODS, method_config, parse_methods, round_order
from gpt2_bench.compare_hosts import HOST_METHODS, hosts_report, parse_host_methods
from gpt2_bench.config import TrainConfig
from gpt2_bench.launch import run, scaled_link, summarise
from testbed.link import parse_rate
from testbed.paper import TABLE as PAPER



def bytes_model_ms(plain_iter_ms: float, plain_wire: float, wire: float, rate_bps: Optional[int]) -> Optional[float]:
    """The step time if a run differed from plain FSDP only in the bytes it puts on the link:
    ``plain_iter - (plain_wire - wire) / rate`` (wire in bytes per rank and step, the rate per
    rank). What compression can buy when its compute hides under the link; ``None`` unshaped."""
    if rate_bps is None or plain_wire is None or wire is None:
        return None
    return plain_iter_ms - (plain_wire - wire) * 8 / rate_bps * 1e3


def compare(base: TrainConfig) -> tuple[list[dict], dict]:
    """Run the three trainings on one link; returns (rows, link info)."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare(base.dataset, base.cache_dir))
    link_info = {"rate": base.link}
    if base.link == "scaled":
        link_info = scaled_link(base, data_dir)
    runs = {}
    for compression in ("none", "all", "non-attn"):
        cfg = dataclasses.replace(base, compression=compression, name=None)
        runs[compression] = run(cfg, data_dir, link=link_info["rate"], attempts=RUN_ATTEMPTS)
    plain = runs["none"]
    serial = plain if not base.overlap else run(dataclasses.replace(base, compression="none", name=None, overlap=False),
                                                  data_dir, link=link_info["rate"], attempts=RUN_ATTEMPTS)
    if serial.get("exchange_ms_per_mb") is not None:  # the calibration's definition: share of a non-overlapped step
        link_info["measured_share"] = serial["exchange_ms_per_mb"] * serial["grad_mb"] / serial["iter_ms"]
    link_info["overlap"] = overlap_summary(plain, serial, base)
    rows = []
    for compressed in ("all", "non-attn"):  # the paper's layout: one plain row per setting
        rows.append({**plain, "compressed": compressed})
        rows.append(runs[compressed])
    if serial is not plain:
        rows.append({**serial, "algorithm": "fsdp no-overlap", "compressed": "-", "method": "fsdp-no-overlap"})
    rate_bps = parse_rate(link_info["rate"])
    for row in rows:
        row["speedup"] = plain["iter_ms"] / row["iter_ms"]
        model_ms = bytes_model_ms(plain["iter_ms"], plain.get("wire_bytes_per_step"), row.get("wire_bytes_per_step"), rate_bps)
        row["bytes_model_speedup"] = None if model_ms is None or model_ms <= 0 else plain["iter_ms"] / model_ms
        row["speedup_total"] = plain["train_s"] / row["train_s"]
        row["val_loss_vs_fsdp"] = row["val_loss"] / plain["val_loss"] - 1
        # the columns every compare's JSON rows share (see methods_report)
        row["method"] = row["method"] if "method" in row else ("fsdp" if row["algorithm"] == "fsdp" else f"tagc-{row['compressed']}")
        row["bytes_model"] = row["bytes_model_speedup"]
        row["val_loss_delta"] = row["val_loss_vs_fsdp"]
        row["speedup_vs_fsdp_bf16"] = None
        wire = row.get("wire_bytes_per_step")
        row["bits_per_param"] = None if wire is None else wire * 8 / row["n_params"]
    return rows, link_info


def block_hidden(row: dict) -> Optional[float]:
    """The share of the block units' exchange time hidden behind other work (1 - exposed / wire)."""
    blocks = [u for name, u in (row.get("units") or {}).items() if name != "<root>"]
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


def overlap_summary(plain: dict, serial: dict, base: TrainConfig) -> dict:
    """What overlap can hide here, worked out from bytes and measured compute, beside what it did.

    Only the blocks' exchanges can hide (the root unit's gradient, with the embedding, is complete
    at the very end of backward); each hides behind the backward compute that follows its launch.
    So the ceiling is ``min(blocks' exchange time, compute after the first block's launch)``, taken
    from the non-overlapped plain run, as a share of its step.
    """
    info: dict = {"shares": {preset: unit_byte_shares(preset) for preset in dict.fromkeys((base.preset, "gpt2-untied"))}}
    line = serial.get("timeline")
    if line and serial.get("units"):
        launches = [ev[1] for unit in line["units"] for ev in unit["events"] if ev[0] == "wire"]
        exchange_spans = sum(ev[2] - ev[1] for unit in line["units"] for ev in unit["events"] if ev[0] != "wire")
        backward_end = line["backward"][1]
        compute_after = max(0.0, backward_end - min(launches) - exchange_spans) if launches else 0.0
        blocks_wire = sum(u["wire_ms"] for name, u in serial["units"].items() if name != "<root>")
        ceiling_ms = min(blocks_wire, compute_after)
        info.update(blocks_wire_ms=blocks_wire, compute_after_ms=compute_after, ceiling_ms=ceiling_ms,
                    ceiling_speedup=serial["iter_ms"] / max(1e-9, serial["iter_ms"] - ceiling_ms))
    info["measured_speedup"] = serial["iter_ms"] / plain["iter_ms"]
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
                         f"{share:.2f} x {shares['blocks']:.2f} = {share * shares['blocks']:.1%} of a step in `{preset}` "
                         f"({1 / (1 - share * shares['blocks']):.3f}x).")
    if "ceiling_ms" in info:
        lines.append(f"- Measured (non-overlapped plain run): the blocks' exchanges take {info['blocks_wire_ms']:.0f} ms of wire; "
                     f"the backward computes {info['compute_after_ms']:.0f} ms after the first block's launch, so a perfect "
                     f"overlap hides {info['ceiling_ms']:.0f} ms: ceiling {info['ceiling_speedup']:.3f}x.")
    if info.get("measured_speedup"):
        hidden = info.get("blocks_hidden")
        lines.append(f"- Overlapped plain against non-overlapped plain: {info['measured_speedup']:.3f}x"
                     + ("" if hidden is None else f"; the block units' exchanges were {hidden:.0%} hidden (median step)") + ".")
    return "\n".join(lines)


def format_table(rows: list[dict], link_info: dict) -> str:
    lines = [
        f"link: {link_info['rate']}" + (f" per rank (scaled: 10gbit / {link_info['slowdown']:.0f}, so the plain exchange takes the "
                                        f"paper's {link_info['exchange_share']:.0%} of a step)" if "slowdown" in link_info else "")
        + (f"; in the plain run it took {link_info['measured_share']:.0%}" if "measured_share" in link_info else ""),
        "",
        "| algorithm | compressed | iter ms | speed-up | bytes model | total s | speed-up (total) | exchange ms/MB | "
        "wire ms | exposed ms | blocks hidden | wire MiB/rank/step | val loss | vs fsdp | peel | paper iter | paper ms/MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row, paper in zip(rows, PAPER + [{"iter": "-", "exchange_ms_per_mb": "-"}]):
        hidden = block_hidden(row)
        wire = row.get("wire_bytes_per_step") or row["wire_bytes_per_rank"]  # a steady step's, where logged
        peel = row["peel_success"]
        model = row.get("bytes_model_speedup")
        lines.append(
            f"| {row['algorithm']} | {row['compressed']} | {row['iter_ms']:.0f} | {row['speedup']:.2f}x | "
            f"{'-' if model is None else f'{model:.2f}x'} | "
            f"{row['train_s']:.1f} | {row['speedup_total']:.2f}x | "
            f"{row['exchange_ms_per_mb']:.2f} | {_ms(row.get('wire_ms'))} | {_ms(row.get('exposed_ms'))} | "
            f"{'-' if hidden is None else f'{hidden:.0%}'} | {wire / 2**20:.2f} | {row['val_loss']:.4f} | {100 * row['val_loss_vs_fsdp']:+.2f}% | "
            f"{'-' if peel is None else f'{100 * peel:.2f}%'} | {paper['iter']} | {paper['exchange_ms_per_mb']} |"
        )
    return "\n".join(lines)


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot_timeline(rows: list[dict], path: Path) -> None:
    """One steady step of each distinct run: forward / backward / optimizer, the training thread's
    codec and wait spans, and each unit's bytes on the wire."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for row in rows:
        label = row["algorithm"] if row["algorithm"] != "tagc" else f"tagc {row['compressed']}"
        if row.get("timeline") and label not in [r[0] for r in runs]:
            runs.append((label, row["timeline"]))
    if not runs:
        return
    colors = {"forward": "#9ecae1", "backward": "#3182bd", "optimizer": "#756bb1", "compress": "#fd8d3c", "decode": "#31a354",
              "wait": "#de2d26", "wire": "#636363"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.2 + 0.32 * max(len(t["units"]) + 2 for _, t in runs) * len(runs)),
                             squeeze=False)
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


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    seen = set()
    for row in rows:
        label = row["algorithm"] if row["algorithm"] != "tagc" else f"tagc {row['compressed']}"
        if label in seen:
            continue
        seen.add(label)
        curve = row["curve"]
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


# ----------------------------------------------------------------------------- every method, at several shares


RUN_ATTEMPTS = 3
"""Every run the compare makes is started again if a rank dies (twice at most): see :func:`gpt2_bench.launch.run`."""
HOSTS_DEFAULTS = {"preset": "tiny", "link": "100mbit", "steps": 12, "eval_interval": 12, "compression": "all",
                  "integration": "fsdp2", "dense_steps": 2, "block_size": 64, "out_dir": "bench_out/hosts"}
"""The defaults with ``--hosts``: the tiny preset, all layers compressed, a 100 Mbit/s link per host."""

QUALITY_CHECKPOINTS = 6
"""A quality run checkpoints this many times, so a crash costs at most a sixth of it."""
QUALITY_KEPT_CHECKPOINTS = 2
"""A quality run keeps its newest checkpoints only (a long run's full set fills a disk)."""


def _pooled_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def time_methods(base: TrainConfig, methods: Sequence[str], share: float, rounds: int, data_dir: str) -> tuple[list[dict], dict]:
    """Every method on one scaled link, ``rounds`` rounds, every other one in reverse order (so a
    drift over the session lands on every method alike); a method's step time is the median of
    its steady steps pooled over the rounds. Returns (one row per method, link info)."""
    cfg = dataclasses.replace(base, link_share=share)
    link_info = scaled_link(cfg, data_dir) if base.link == "scaled" else {"rate": base.link, "exchange_share": None}
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for round_index in range(rounds):
        for method in round_order(methods, round_index):
            method_cfg = dataclasses.replace(method_config(cfg, method),
                                             out_dir=str(Path(base.out_dir) / f"share-{share:g}" / f"round-{round_index + 1}"))
            runs[method].append(run(method_cfg, data_dir, link=link_info["rate"], attempts=RUN_ATTEMPTS))
    rows = []
    for method in methods:
        last = runs[method][-1]
        row = {**last, "method": method, "share": share, "link": link_info["rate"], "link_info": link_info,
               "preset": base.preset, "dense_steps": base.dense_steps, "rounds": rounds,
               "iter_ms": _pooled_median([ms for result in runs[method] for ms in result["steady_iter_ms"]]),
               "iter_ms_per_round": [result["iter_ms"] for result in runs[method]]}
        rows.append(row)
    return rows, link_info


HOW_NOT_WHAT = ("checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume", "max_time_s", "group_timeout_s", "fault_step",
                "diagnostics")
"""Settings that change how a run is carried out, not its losses."""


def _same_math(recorded: dict, wanted: dict) -> bool:
    """Whether two runs' settings give the same losses (they may differ in :data:`HOW_NOT_WHAT`).

    A setting the recorded run does not list was added to :class:`TrainConfig` after it ran:
    it ran with what is now that setting's default (a new setting's default keeps the old behaviour).
    """
    defaults = json.loads(TrainConfig().to_json())
    recorded = {**{k: defaults[k] for k in wanted if k not in recorded and k in defaults}, **recorded}
    strip = lambda settings: {k: v for k, v in settings.items() if k not in HOW_NOT_WHAT}  # noqa: E731
    return strip(recorded) == strip(wanted)


def quality_runs(base: TrainConfig, methods: Sequence[str], steps: int, data_dir: str,
                 dense_steps: Optional[int] = None, folder: Optional[Path] = None,
                 configure: Optional[Callable[[TrainConfig, str], TrainConfig]] = None) -> dict[str, dict]:
    """Each method once, unshaped, for ``steps`` steps: its loss does not depend on the link.
    ``dense_steps`` (default: the timed runs') is the error-feedback codecs' dense warm-up here.

    Runs live in ``<out_dir>/quality``, each beside the settings it ran with. A finished run
    with the same settings is read back instead of trained again, so the long quality runs are
    made once (in the background, or over several sessions) and the timed sweeps added later.
    An interrupted run (``<name>.started.json`` with the same settings) resumes from its newest
    checkpoint, with the same losses as an uninterrupted one. ``folder``: where the runs live
    (default ``<out_dir>/quality``). ``configure``: a method's settings from ``base`` (default
    :func:`~gpt2_bench.methods.method_config`; a layout's: :func:`~gpt2_bench.methods.layout_config`).
    """
    configure = configure or method_config
    eval_interval = max(1, steps // 15)  # from the steps alone: the timed runs' settings do not change it
    results = {}
    for method in methods:
        warm = base if dense_steps is None else dataclasses.replace(base, dense_steps=dense_steps)
        out = Path(base.out_dir) / "quality" if folder is None else Path(folder)
        cfg = dataclasses.replace(configure(warm, method), steps=steps, link="none", eval_interval=eval_interval,
                                  out_dir=str(out), checkpoint_dir=str(out / f"checkpoints-{method}"),
                                  checkpoint_every=max(1, steps // QUALITY_CHECKPOINTS),
                                  keep_checkpoints=QUALITY_KEPT_CHECKPOINTS)
        settings, log = out / f"{cfg.run_name}.config.json", out / f"{cfg.run_name}.jsonl"
        started = out / f"{cfg.run_name}.started.json"
        wanted = json.loads(cfg.to_json())
        if settings.exists() and log.exists() and _same_math(json.loads(settings.read_text()), wanted):
            try:
                results[method] = summarise(cfg, log, "none")
                print(f"quality: {method}: reusing the finished run in {log}", file=sys.stderr)
                continue
            except (StopIteration, ValueError, KeyError):  # an unfinished log: train again
                pass
        settings.unlink(missing_ok=True)
        if started.exists() and _same_math(json.loads(started.read_text()), wanted):
            cfg = dataclasses.replace(cfg, resume=True)  # an interrupted run (a killed session): go on from its checkpoint
            print(f"quality: {method}: resuming the unfinished run from {cfg.checkpoint_dir}", file=sys.stderr)
        else:
            shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)  # another run's checkpoints must not be resumed
            out.mkdir(parents=True, exist_ok=True)
            started.write_text(cfg.to_json())
        results[method] = run(cfg, data_dir, link="none", attempts=RUN_ATTEMPTS)
        settings.write_text(cfg.to_json())
        started.unlink(missing_ok=True)
    return results


def seeded_quality_runs(base: TrainConfig, methods: Sequence[str], steps: int, data_dir: str, seeds: Sequence[int],
                        dense_steps: Optional[int] = None) -> dict[int, dict[str, dict]]:
    """:func:`quality_runs` once per seed, each seed's runs in ``<out_dir>/quality/seed-<seed>``
    (read back, or resumed, as there): ``{seed: {method: result}}``."""
    return {seed: quality_runs(dataclasses.replace(base, seed=seed), methods, steps, data_dir, dense_steps,
                               folder=Path(base.out_dir) / "quality" / f"seed-{seed}") for seed in seeds}


def losses_from(path: str) -> dict[str, dict]:
    """The val losses of another compare's JSON rows (``--json``), per method: e.g. the small
    preset's quality runs for a timing-only sweep of ``gpt2-untied``."""
    rows = json.loads(Path(path).read_text())
    found = {}
    for row in rows:
        if row.get("method") and row.get("val_loss") is not None:
            found[row["method"]] = {"val_loss": row["val_loss"], "steps": row.get("val_loss_steps") or row.get("steps"),
                                    "preset": row.get("preset")}
    if not found:
        raise ValueError(f"{path} holds no rows with a method and a val_loss (write one with --json)")
    return found


def timed_rows_from(path: str, methods: Sequence[str], preset: str) -> list[tuple[float, list[dict], dict]]:
    """Another compare's timed rows (``--json``), per share in their order, with each share's link:
    the report made again without timing again, e.g. once a longer run's losses arrive (``--loss-from``)."""
    rows = [row for row in json.loads(Path(path).read_text()) if row.get("method") and row.get("iter_ms")]
    if not rows:
        raise ValueError(f"{path} holds no timed rows (write them with --json)")
    presets = {row["preset"] for row in rows if row.get("preset")}
    if presets - {preset}:
        raise ValueError(f"--timed-from {path} was timed on preset {', '.join(sorted(presets))}: give --preset "
                         f"{sorted(presets)[0]}")
    shares = list(dict.fromkeys(row.get("share") for row in rows))
    found = []
    for share in shares:
        by_method = {row["method"]: dict(row) for row in rows if row.get("share") == share}
        missing = [method for method in methods if method not in by_method]
        if missing:
            raise ValueError(f"--timed-from {path} has no rows for {', '.join(missing)} at share {share}; "
                             f"it has {', '.join(by_method)}")
        share_rows = [by_method[method] for method in methods]
        link_info = share_rows[0].get("link_info") or {"rate": share_rows[0]["link"], "exchange_share": share,
                                                      "rate_bps": parse_rate(share_rows[0]["link"]), "timed_in": path}
        found.append((share, share_rows, link_info))
    return found


def add_method_columns(rows: list[dict], rate_bps: Optional[int], quality: Optional[dict[str, dict]] = None,
                       plain_method: str = "fsdp", bf16_method: str = "fsdp-bf16") -> list[dict]:
    """Speed-ups against ``plain_method`` and ``bf16_method`` (``fsdp``, ``fsdp-bf16``; the DDP layout's
    ``ddp``, ``ddp-bf16``), the bytes model, bits per parameter and the val loss (from the quality runs
    when given) against ``plain_method``'s, for one share's rows."""
    by_method = {row["method"]: row for row in rows}
    plain, bf16 = by_method.get(plain_method), by_method.get(bf16_method)
    for row in rows:
        if quality and row["method"] in quality:
            row["val_loss"] = quality[row["method"]]["val_loss"]
            row["curve"] = quality[row["method"]].get("curve") or []
            row["val_loss_steps"] = quality[row["method"]]["steps"]
        wire = row.get("wire_bytes_per_step")
        row["bits_per_param"] = None if wire is None else wire * 8 / row["n_params"]
        row["speedup"] = plain["iter_ms"] / row["iter_ms"] if plain else None
        row["speedup_vs_fsdp_bf16"] = bf16["iter_ms"] / row["iter_ms"] if bf16 else None
        model_ms = None if plain is None else bytes_model_ms(plain["iter_ms"], plain.get("wire_bytes_per_step"), wire, rate_bps)
        row["bytes_model"] = None if model_ms is None or model_ms <= 0 else plain["iter_ms"] / model_ms
        row["bytes_model_ms"] = model_ms
    plain_loss = quality[plain_method]["val_loss"] if quality and plain_method in quality else (plain or {}).get("val_loss")
    plain_steps = (plain or {}).get("val_loss_steps")
    for row in rows:
        row["val_loss_delta"] = None if plain_loss is None or not same_run_length(row, plain_steps) else row["val_loss"] / plain_loss - 1
    return rows


def same_run_length(row: dict, plain_steps: Optional[int]) -> bool:
    """Whether ``row``'s val loss comes from a run as long as fsdp's (unknown lengths count as
    the same): a 300-step loss set against a 2,000-step one would be a gap of training, not of method."""
    steps = row.get("val_loss_steps")
    return steps is None or plain_steps is None or steps == plain_steps


LOSS_TOLERANCE = 0.01
"""A method counts as keeping plain FSDP's loss within this relative val-loss gap."""


def winner(rows: list[dict]) -> Optional[dict]:
    """The fastest row whose val loss is within :data:`LOSS_TOLERANCE` of ``fsdp``'s."""
    eligible = [row for row in rows if row.get("val_loss_delta") is not None and row["val_loss_delta"] <= LOSS_TOLERANCE]
    return min(eligible, key=lambda row: row["iter_ms"]) if eligible else None


def explain_gap(row: dict, other: dict) -> str:
    """``row``'s step time against ``other``'s, split into bytes (the bytes model's difference),
    codec time on the training thread, and the rest; plus the loss difference."""
    total = row["iter_ms"] - other["iter_ms"]
    parts = []
    if row.get("bytes_model_ms") is not None and other.get("bytes_model_ms") is not None:
        parts.append(f"bytes {row['bytes_model_ms'] - other['bytes_model_ms']:+.0f} ms")
    codec = (row.get("codec_ms") or 0.0) - (other.get("codec_ms") or 0.0)
    parts.append(f"codec {codec:+.0f} ms")
    loss = ""
    if row.get("val_loss_delta") is not None and other.get("val_loss_delta") is not None:
        loss = f"; val loss {100 * (row['val_loss_delta'] - other['val_loss_delta']):+.2f} points"
    return f"{total:+.0f} ms ({', '.join(parts)}){loss}"


def format_methods_table(rows: list[dict], plain_method: str = "fsdp", bf16_method: str = "fsdp-bf16") -> str:
    """One share's methods: time, speed-ups (against ``plain_method`` and ``bf16_method``), bytes, codec time and loss."""
    lines = [f"| method | compressed | iter ms | vs {plain_method} | vs {bf16_method} | bytes model | wire MB/step | bits/param | "
             f"codec ms | exposed ms | val loss | vs {plain_method} |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda value, spec, suffix="": "-" if value is None else f"{value:{spec}}{suffix}"  # noqa: E731
    for row in rows:
        wire = row.get("wire_bytes_per_step")
        delta = row.get("val_loss_delta")
        lines.append(
            f"| {row['method']} | {row['compressed'] if row['algorithm'] != 'fsdp' else '-'} | {row['iter_ms']:.0f} | "
            f"{fmt(row.get('speedup'), '.2f', 'x')} | {fmt(row.get('speedup_vs_fsdp_bf16'), '.2f', 'x')} | "
            f"{fmt(row.get('bytes_model'), '.2f', 'x')} | {fmt(None if wire is None else wire / 1e6, '.2f')} | "
            f"{fmt(row.get('bits_per_param'), '.2f')} | {fmt(row.get('codec_ms'), '.0f')} | {fmt(row.get('exposed_ms'), '.0f')} | "
            f"{row['val_loss']:.4f}{other_length(row)} | {fmt(None if delta is None else 100 * delta, '+.2f', '%')} |")
    return "\n".join(lines)


def other_length(row: dict) -> str:
    """`` (N steps)`` after a val loss from a run of another length than fsdp's (so not compared)."""
    return f" ({row['val_loss_steps']} steps)" if row.get("val_loss_delta") is None and row.get("val_loss_steps") else ""


def format_verdict(rows: list[dict]) -> str:
    """The share's winner, and where TAGC stands against it, ``fsdp`` and ``fsdp-bf16``."""
    best = winner(rows)
    by_method = {row["method"]: row for row in rows}
    lines = []
    if best is None:
        lines.append(f"- No method kept val loss within {LOSS_TOLERANCE:.0%} of fsdp's.")
    else:
        lines.append(f"- Fastest within {LOSS_TOLERANCE:.0%} of fsdp's val loss: **{best['method']}** "
                     f"({best['iter_ms']:.0f} ms, {best['speedup']:.2f}x over fsdp"
                     + (f", {best['speedup_vs_fsdp_bf16']:.2f}x over fsdp-bf16" if best.get("speedup_vs_fsdp_bf16") else "")
                     + f", val loss {100 * best['val_loss_delta']:+.2f}%).")
    for name in ("tagc-non-attn", "tagc-all"):
        row = by_method.get(name)
        if row is None:
            continue
        text = f"- `{name}`: {row['speedup']:.2f}x over fsdp" if row.get("speedup") else f"- `{name}`"
        if row.get("speedup_vs_fsdp_bf16"):
            text += f", {row['speedup_vs_fsdp_bf16']:.2f}x over fsdp-bf16"
        if best is not None and best is not row:
            text += f"; against {best['method']}: {explain_gap(row, best)}"
        faster = [other["method"] for other in rows if other is not row and other["iter_ms"] < row["iter_ms"]
                  and _no_worse_loss(other, row)]
        text += f". Dominated by {', '.join(faster)} (faster, and no worse in loss)." if faster else ". Not dominated."
        lines.append(text)
    return "\n".join(lines)


def _no_worse_loss(other: dict, row: dict) -> bool:
    """``other``'s val loss is no worse than ``row``'s, from runs of the same length."""
    comparable = same_run_length(other, row.get("val_loss_steps"))
    return comparable and other["val_loss"] <= row["val_loss"]


def _label_colors(methods: Sequence[str]) -> dict:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {method: cmap(i % 10) for i, method in enumerate(methods)}


def plot_pareto(rows: list[dict], path: Path) -> None:
    """Step time against val loss, one point per method per share (lower left is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(row["method"] for row in rows))
    shares = sorted({row["share"] for row in rows})
    colors, markers = _label_colors(methods), "osD^v<>"
    fig, axes = plt.subplots(1, len(shares), figsize=(5.5 * len(shares), 4.2), squeeze=False)
    for ax, share in zip(axes[0], shares):
        for row in (r for r in rows if r["share"] == share):
            ax.scatter(row["iter_ms"], row["val_loss"], color=colors[row["method"]], marker=markers[methods.index(row["method"]) % 7], s=50)
            ax.annotate(row["method"] + other_length(row), (row["iter_ms"], row["val_loss"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set(xlabel="median step (ms)", ylabel="val loss", title=f"share {share:g}: time against loss")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup_vs_share(rows: list[dict], path: Path) -> None:
    """One line per method: its speed-up over fsdp against the plain exchange's share of a step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(row["method"] for row in rows))
    colors = _label_colors(methods)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method in methods:
        points = sorted((row["share"], row["speedup"]) for row in rows if row["method"] == method and row.get("speedup"))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method, color=colors[method])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xlabel="share of a non-overlapped plain step (the exchange's, or the link's past what it can take)", ylabel="speed-up over fsdp", title="speed-up against share")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def val_loss_vs_fsdp(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Per method, ``(step, percent)``: its val loss against fsdp's at the same evaluation step
    (only the steps both evaluated); empty without an ``fsdp`` row."""
    curves = {row["method"]: [c for c in row["curve"] if c.get("val_loss") is not None] for row in rows}
    plain = {c["step"]: c["val_loss"] for c in curves.get("fsdp", [])}
    if not plain:
        return {}
    return {method: [(c["step"], 100 * (c["val_loss"] / plain[c["step"]] - 1)) for c in curve if c["step"] in plain]
            for method, curve in curves.items()}


def plot_method_losses(rows: list[dict], path: Path) -> None:
    """Every method's training loss and val loss against step; with ``fsdp`` among them, also
    each val loss relative to fsdp's at the same step (long runs part by a few percent, which
    the absolute curves hide)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen: dict[str, dict] = {}
    for row in rows:
        seen.setdefault(row["method"], row)
    colors = _label_colors(list(seen))
    relative = val_loss_vs_fsdp(list(seen.values()))
    fig, axes = plt.subplots(1, 3 if relative else 2, figsize=(16 if relative else 11, 4))
    train_ax, val_ax = axes[0], axes[1]
    for method, row in seen.items():
        curve = row["curve"]
        train_ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=method, color=colors[method], lw=0.9)
        vals = [c for c in curve if c.get("val_loss") is not None]
        val_ax.plot([c["step"] for c in vals], [c["val_loss"] for c in vals], marker="o", label=method, color=colors[method])
        if relative:
            axes[2].plot(*zip(*relative[method]), marker="o", label=method, color=colors[method])
    train_ax.set(xlabel="step", ylabel="training loss", title="training loss")
    val_ax.set(xlabel="step", ylabel="val loss", title="val loss")
    if relative:
        axes[2].axhspan(-1, 1, color="grey", alpha=0.12, label="within 1% of fsdp")
        axes[2].set(xlabel="step", ylabel="val loss vs fsdp's at the same step (%)", title="val loss against fsdp")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_quality_report(quality: dict[str, dict], steps: int, plateau: Optional[float] = None) -> str:
    """The quality runs as Markdown: each method's val loss at every evaluation step, against
    fsdp's at the same step, and the final verdict per method; with ``plateau`` (the unigram
    loss, :meth:`gpt2_bench.data.TokenData.unigram_loss`), how far below it plain fell."""
    rows = [{"method": method, **result} for method, result in quality.items()]
    relative = {method: dict(points) for method, points in val_loss_vs_fsdp(rows).items()}
    evals = {row["method"]: {c["step"]: c["val_loss"] for c in row.get("curve", []) if c.get("val_loss") is not None}
             for row in rows}
    methods = list(evals)
    lines = [f"# GPT-2: val loss of the quality runs ({steps} steps, unshaped)", ""]
    plain = quality.get("fsdp", {}).get("val_loss")
    if plateau is not None:
        where = (f"; fsdp ends at {plain:.4f}, {plateau - plain:.2f} nats below it" if plain is not None else "")
        lines += [f"Unigram plateau (val tokens under the train split's token frequencies): {plateau:.4f}{where}. "
                  f"Methods part only past it.", ""]
    steps_seen = sorted({step for curve in evals.values() for step in curve})
    if steps_seen:
        lines += ["| step | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
        for step in steps_seen:
            cells = []
            for method in methods:
                value = evals[method].get(step)
                percent = relative.get(method, {}).get(step) if method != "fsdp" else None
                cells.append("" if value is None else f"{value:.4f}" + (f" ({percent:+.2f}%)" if percent is not None else ""))
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    for method, result in quality.items():
        text = f"- `{method}`: val loss {result['val_loss']:.4f}"
        if plain is not None and method != "fsdp":
            delta = result["val_loss"] / plain - 1
            text += f", {delta:+.2%} against fsdp: " + ("within" if delta <= LOSS_TOLERANCE else "outside") + \
                    f" {LOSS_TOLERANCE:.0%}"
        lines.append(text)
    lines += ["", "![losses](losses.png)", ""]
    return "\n".join(lines)


SHARE_ARITHMETIC = (
    "Where the shares come from. **0.31** is the paper's: TAGC cut its exchange from 0.76 to 0.51 ms/MB (x0.67) and "
    "its iteration from 25.2 to 22.6, so the exchange was 2.6 / (1 - 0.67) = 7.9 of 25.2 units. **0.9** is an "
    "H100-class GPU over 10 GbE: GPT-2 (124M) on 16 x 1024 tokens per GPU is 6 x 124e6 x 16384 = 1.2e13 FLOP, "
    "30 ms at 400 TFLOP/s (40% of bf16 peak), while its fp32 gradient reduce-scatter moves ~(N-1)/N x 496 MB, "
    "~0.4 s at 1.25 GB/s, and its parameter all-gathers (bf16, forward and backward) ~0.4 s more: the link holds "
    "0.8 / 0.83 = 0.96 of a non-overlapped step, the reduce-scatter alone ~0.5. Here too the all-gathers cross the "
    "emulated link, so at 0.9 the link-bound time gets the share.")


def format_share_arithmetic(link_info: dict) -> str:
    """How the scaled link gives the plain exchange its share of a step."""
    if not link_info.get("rate_bps"):
        return f"- link {link_info['rate']} (not scaled)"
    if link_info.get("timed_in"):  # rows written before they carried their link's arithmetic
        return f"- share {link_info['exchange_share']:g}: link {link_info['rate']}; timed in {link_info['timed_in']}."
    share = link_info["exchange_share"]
    if link_info.get("share_of") == "link":
        what = (f"the link-bound time of a non-overlapped plain step (exchange and all-gathers) is {share:.0%} of it; "
                f"the plain exchange alone is {link_info['modelled_exchange_share']:.0%} (it cannot take {share:.0%} "
                f"here, since the all-gathers cross the same link)")
    else:
        what = f"the plain exchange is {share:.0%} of a non-overlapped plain step"
    return (f"- share {share:g}: a plain step computes {link_info['rest_ms']:.0f} ms here; the link is "
            f"{link_info['rate']} (10gbit / {link_info['slowdown']:.0f}), at which {what} (first guess "
            f"{link_info['first_guess']} gave the exchange {link_info['first_guess_share']:.0%}).")


def methods_report(base: TrainConfig, methods: Sequence[str], shares: Sequence[float], rounds: int, quality_steps: int,
                   quality_dense_steps: Optional[int] = None, loss_from: Optional[str] = None,
                   timed_from: Optional[str] = None, seeds: Optional[Sequence[int]] = None) -> tuple[list[dict], str]:
    """Time every method at every share (and measure its loss once, unshaped); returns the rows and
    a Markdown report, with plots written next to it. ``timed_from`` takes the timed rows of an
    earlier compare instead of timing again (its shares, rounds, steps and dense warm-up). With
    ``seeds``, the quality runs are made at every seed and a method's val loss is their mean."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare(base.dataset, base.cache_dir)) if quality_steps or not timed_from else ""
    if quality_steps and seeds:
        from gpt2_bench.quality import mean_quality

        quality = mean_quality(seeded_quality_runs(base, methods, quality_steps, data_dir, seeds, quality_dense_steps))
    else:
        quality = quality_runs(base, methods, quality_steps, data_dir, quality_dense_steps) if quality_steps else None
    if loss_from:
        quality = losses_from(loss_from)
        missing = [m for m in methods if m not in quality]
        if missing:
            raise ValueError(f"--loss-from {loss_from} has no val loss for {', '.join(missing)}")
    rows, sections = [], []
    timed = (timed_rows_from(timed_from, methods, base.preset) if timed_from else
             [(share, *time_methods(base, methods, share, rounds, data_dir)) for share in shares])
    if timed_from:
        shares = [share for share, _, _ in timed]
        first = timed[0][1][0]
        rounds = first.get("rounds", rounds)
        base = dataclasses.replace(base, steps=first["steps"], dense_steps=first.get("dense_steps", base.dense_steps))
    for share, share_rows, link_info in timed:
        add_method_columns(share_rows, parse_rate(link_info["rate"]), quality)
        rows.extend(share_rows)
        title = f"Share {share:g}" if link_info.get("rate_bps") else f"Link {link_info['rate']}"
        sections.append(f"## {title}\n\n{format_share_arithmetic(link_info)}\n\n{format_methods_table(share_rows)}\n\n"
                        f"{format_verdict(share_rows)}\n")
    out = Path(base.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_pareto(rows, out / "pareto.png")
    plot_method_losses(rows, out / "losses.png")
    pictures = "![pareto](pareto.png)\n\n![losses](losses.png)\n"
    if len(shares) > 1:
        plot_speedup_vs_share(rows, out / "speedup_vs_share.png")
        pictures += "\n![speed-up against share](speedup_vs_share.png)\n"
    quality_dense = base.dense_steps if quality_dense_steps is None else quality_dense_steps
    loss_source = (f"val loss from {loss_from} (its own runs: the loss does not depend on the link)" if loss_from else
                   f"val loss from {'one unshaped run' if not seeds else f'the mean of unshaped runs at seeds {seeds}'} of "
                   f"{quality_steps} steps per method (the loss does not depend on the link; error-feedback codecs dense for "
                   f"its first {quality_dense} steps)"
                   if quality else f"val loss from the timed runs ({base.steps} steps)")
    report = (f"# GPT-2: the methods users would pick, on one engine and one link\n\n"
              f"Model preset `{base.preset}`, {base.world} ranks, {base.batch_size}x{base.block_size or 'preset'} tokens per "
              f"rank and step, integration `{base.integration}`, seed {base.seed}; timed runs of {base.steps} steps, "
              f"{rounds} round(s) per share, every other round in reverse order, step time = median of the steady steps "
              f"pooled over rounds (dense warm-up steps excluded{f'; timed in {timed_from}' if timed_from else ''}); "
              f"{loss_source}. TAGC and top-k at ratio {base.ratio:g}; "
              f"error-feedback codecs dense for the first {base.dense_steps} steps.\n\n"
              f"`bytes model`: the speed-up if a method differed from fsdp only in its bytes on the link; `bits/param`: "
              f"wire bits per gradient element per rank and step (plain fp32 on 2 ranks: 16); `codec ms`: encode + decode "
              f"on the training thread per step.\n\n{SHARE_ARITHMETIC}\n\n" + "\n".join(sections) + "\n" + pictures)
    (out / "methods.md").write_text(report)
    return rows, report


def main(argv: Optional[Sequence[str]] = None) -> int:
    from gpt2_bench.config import build_parser, config_from_args

    parser = build_parser()
    parser.prog = "python -m gpt2_bench.compare"
    parser.description = __doc__.split("\n\n")[0]
    # 60 steps of 4x128 tokens per rank (~15 min on 2 CPU cores); the dense warm-up is the library's (tagc.hook(): 10 steps
    # for TAGC; ``--dense-steps 0`` to see plain top-k from step 0: +11% val loss at 30 steps, the early LM-head moves that
    # error feedback spreads out).
    parser.set_defaults(link="scaled", out_dir="bench_out/compare", steps=60, block_size=128, eval_interval=20)
    hosts_probe = argparse.ArgumentParser(add_help=False)
    hosts_probe.add_argument("--hosts", type=int, default=1)
    if hosts_probe.parse_known_args(argv)[0].hosts > 1:  # emulated hosts: a short job per method on the tiny model
        parser.set_defaults(**HOSTS_DEFAULTS)
    parser.add_argument("--json", default=None, help="write the result rows (a JSON list) here")
    parser.add_argument("--layout", default="flat", choices=("flat", "ddp", "hsdp"),
                        help="flat (default): FSDP sharded over every rank; ddp: DDP on 2 emulated hosts x 1 rank (torch's "
                             "hooks and ours through tagc.ddp_hook); hsdp: FSDP2 HSDP on 2 x 2. Each is timed on the "
                             "link the flat compare calibrates for the share, beside flat FSDP on the same hosts "
                             "(gpt2_bench.compare_layout)")
    parser.add_argument("--flat-from", default=None,
                        help="--layout ddp/hsdp: take the flat-FSDP rows beside the layout's from an earlier layout "
                             "compare's --json instead of timing them again")
    parser.add_argument("--methods", default="paper",
                        help=f"comma-separated methods: {', '.join(METHODS)}; 'peers' for all of them; "
                             f"default 'paper' ({', '.join(PAPER_METHODS)}, in the paper's table). With --hosts: "
                             f"{', '.join(HOST_METHODS)} (default: all; defaults then {HOSTS_DEFAULTS})")
    parser.add_argument("--shares", default=None,
                        help="comma-separated shares to sweep (e.g. 0.31,0.6,0.9): one scaled link per share, every method "
                             "timed on each, and a speed-up-against-share plot")
    parser.add_argument("--rounds", type=int, default=2, help="timing rounds per share, every other one in reverse (default 2)")
    parser.add_argument("--quality-steps", type=int, default=0,
                        help="measure each method's loss once, unshaped, over this many steps (0: from the timed runs); "
                             "finished runs with the same settings are read back")
    parser.add_argument("--loss-from", default=None,
                        help="take each method's val loss from another compare's --json rows (e.g. the small preset's "
                             "quality runs, for a timing-only sweep of gpt2-untied)")
    parser.add_argument("--timed-from", default=None,
                        help="take the timed rows (and their shares) from an earlier compare's --json instead of timing "
                             "again: its report made again, e.g. with --loss-from a longer run's losses")
    parser.add_argument("--quality-only", action="store_true",
                        help="run (or read back) the quality runs and print their val losses; no timed runs")
    parser.add_argument("--quality-dense-steps", type=int, default=None,
                        help="the quality runs' dense warm-up for error-feedback codecs (default: --dense-steps)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds for the quality runs (e.g. 0,1): every method at every seed, each "
                             "seed's runs in quality/seed-<seed>; the report gives the mean gap to fsdp and the "
                             "seed-to-seed spread at every evaluation and calls a gap inside the spread a tie "
                             "(default: one run at --seed, in quality/)")
    args = parser.parse_args(argv)
    if args.layout != "flat":
        from gpt2_bench.compare_layout import layout_main

        return layout_main(parser, args)
    if args.flat_from:
        parser.error("--flat-from goes with --layout ddp or hsdp")
    if args.hosts > 1:
        return _hosts_main(parser, args)
    try:
        methods = parse_methods(args.methods)
        shares = [float(x) for x in args.shares.split(",")] if args.shares else [args.link_share]
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1 or args.quality_steps < 0 or (args.quality_dense_steps or 0) < 0:
        parser.error("--rounds must be >= 1, --quality-steps and --quality-dense-steps >= 0")
    seeds = None
    if args.seeds is not None:
        from gpt2_bench.quality import parse_seeds

        try:
            seeds = parse_seeds(args.seeds)
        except ValueError as error:
            parser.error(str(error))
        if not args.quality_steps:
            parser.error("--seeds sets the quality runs' seeds: give --quality-steps too")
        if "fsdp" not in methods:
            parser.error("--seeds compares every method with fsdp's run of the same seed: add fsdp to --methods")
    base = config_from_args(args)
    if args.quality_only:
        if not args.quality_steps:
            parser.error("--quality-only needs --quality-steps")
        from gpt2_bench.data import TokenData, prepare

        folder = Path(base.out_dir) / "quality"
        if seeds is not None:
            from gpt2_bench import quality as protocol

            by_seed = seeded_quality_runs(base, methods, args.quality_steps, str(prepare(base.dataset, base.cache_dir)),
                                          seeds, args.quality_dense_steps)
            plateau = TokenData(prepare(base.dataset, base.cache_dir)).unigram_loss()
            tokens = base.batch_size * (base.block_size or _preset_block_size(base.preset)) * base.world
            report = protocol.format_seeds_report(by_seed, args.quality_steps, plateau, tokens, LOSS_TOLERANCE)
            protocol.plot_seed_gaps(by_seed, folder / "gaps.png")
            first = by_seed[seeds[0]]
            plot_method_losses([{"method": method, **result} for method, result in first.items()], folder / "losses.png")
            report += f"\n![gaps](gaps.png)\n\n![losses, seed {seeds[0]}](losses.png)\n"
            (folder / "quality.md").write_text(report)
            print(report)
            print(f"report: {folder / 'quality.md'}", file=sys.stderr)
            return 0
        quality = quality_runs(base, methods, args.quality_steps, str(prepare(base.dataset, base.cache_dir)),
                               args.quality_dense_steps)
        plot_method_losses([{"method": method, **result} for method, result in quality.items()], folder / "losses.png")
        plateau = TokenData(prepare(base.dataset, base.cache_dir)).unigram_loss()
        report = format_quality_report(quality, args.quality_steps, plateau)
        (folder / "quality.md").write_text(report)
        print(report)
        print(f"report: {folder / 'quality.md'}", file=sys.stderr)
        return 0
    if args.loss_from and args.quality_steps:
        parser.error("--loss-from and --quality-steps are two sources of the loss: give one")
    if args.timed_from and args.shares:
        parser.error("--timed-from brings its own shares: leave out --shares")
    if methods != PAPER_METHODS or args.shares or args.quality_steps or args.loss_from or args.timed_from:
        if args.timed_from:
            try:
                timed_rows_from(args.timed_from, methods, base.preset)
            except (OSError, ValueError) as error:
                parser.error(str(error))
        rows, report = methods_report(base, methods, shares, args.rounds, args.quality_steps, args.quality_dense_steps,
                                      args.loss_from, args.timed_from, seeds)
        print(report)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps([{k: v for k, v in row.items() if k not in ("curve", "steady_iter_ms")}
                                                   for row in rows], indent=2) + "\n")
        print(f"\nreport: {Path(base.out_dir) / 'methods.md'}", file=sys.stderr)
        return 0
    rows, link_info = compare(base)
    table = format_table(rows, link_info)
    print(table)
    out = Path(base.out_dir)
    plot(rows, out / "loss.png")
    plot_timeline(rows, out / "timeline.png")
    report = out / "report.md"
    report.write_text(
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
    public = [{k: v for k, v in row.items() if k not in ("curve", "steady_iter_ms")} for row in rows]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(public, indent=2) + "\n")
    print(f"\nreport: {report}\nplot:   {out / 'loss.png'}", file=sys.stderr)
    return 0


def _preset_block_size(preset: str) -> int:
    from gpt2_bench.model import GPTConfig

    return GPTConfig.preset(preset).block_size


def _hosts_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        methods = tuple(HOST_METHODS) if args.methods == "paper" else parse_host_methods(args.methods)
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    from gpt2_bench.config import config_from_args

    base = config_from_args(args)
    rows, report = hosts_report(base, methods, args.rounds)
    print(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nreport: {Path(base.out_dir) / 'hosts.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
