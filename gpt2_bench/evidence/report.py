"""The loss evidence's report: the verdicts (paired gaps, 95% t-intervals), the batch axis, and what
``python -m gpt2_bench.evidence rebuild`` writes from the kept curve files: ``docs/evidence.md``, its plot and the
README's quality block. The protocol and the runs are :mod:`gpt2_bench.evidence`; ``tests/test_evidence.py``
checks that the written files match the kept ones.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from gpt2_bench.evidence import (
    ABLATIONS,
    BATCHES,
    METHODS,
    ROOT,
    ROWS,
    TUNED_ON,
    best_lr,
    complete,
    gap_percent,
    load,
    on_cpu,
    run_name,
    schedule,
    tokens_per_step,
    unsettled_resumes,
)

REPORT = ROOT / "docs" / "evidence.md"
PLOT = ROOT / "docs" / "img" / "evidence-gap.png"
README = ROOT / "README.md"
README_BEGIN, README_END = "<!-- evidence: python -m gpt2_bench.evidence rebuild -->", "<!-- /evidence -->"
GPT2_TOKENS_PER_STEP = 512 * 1024
"""GPT-2's tokens per step (512 sequences of 1,024 tokens): where the batch axis is read off."""
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
"""Student's t 0.975 quantile for 1 to 15 degrees of freedom (a 95% two-sided interval)."""


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the 95% Student's t-interval of the mean of ``values``; one value has no interval
    (``nan`` ends)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan, math.nan
    if n - 1 > len(T_975):
        raise ValueError(f"{n} seeds: extend T_975 past {len(T_975)} degrees of freedom")
    half = T_975[n - 2] * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    """The words for a 95% interval of the mean gap (in %): the bound it is within, a tie, or behind / ahead."""
    if math.isnan(high):
        return "one seed: no verdict"
    if low <= 0 <= high:
        bound = next((f"; within {b:g}%" for b in (0.5, 1.0) if high < b), "")
        return "tie" + bound
    if high < 0:
        return "ahead"
    return next((f"behind, within {b:g}%" for b in (0.5, 1.0) if high < b), "behind")


def pairs(runs: list[dict], method: str, batch: str, lr: str, plain_lr: Optional[str] = None,
          base: str = "plain") -> dict[int, list[tuple[str, float]]]:
    """Per evaluation step both have, every seed's gap (%) of ``method`` at ``lr`` against ``base`` (plain, or an
    ablation's variant) of the same seed and platform at ``plain_lr`` (default ``lr``); a seed is named by its
    number, ``g`` added on a GPU (``"2g"``).
    A seed paired on two CPU platforms counts once: by a run with no uncompressed resumes
    (:func:`unsettled_resumes`) where it has one, else by the first in name order (the runs before fingerprints)."""
    def curves(name: str, at: str) -> dict[tuple[str, int], dict]:
        return {(r.get("platform", "cpu"), r["seed"]): r for r in runs
                if r["method"] == name and r["batch"] == batch and r["lr"] == at}

    bases = curves(base, plain_lr or lr)
    gaps: dict[int, list[tuple[str, float]]] = {}
    methods = curves(method, lr)
    for key in sorted(methods, key=lambda key: (unsettled_resumes(methods[key]) > 0, key)):
        if key not in bases:
            continue
        curve, against = (dict(map(tuple, kept[key]["val_loss"])) for kept in (methods, bases))
        label = f"{key[1]}{'' if key[0].startswith('cpu') else 'g'}"
        for step in sorted(set(curve) & set(against)):
            if label not in dict(gaps.get(step, [])):
                gaps.setdefault(step, []).append((label, gap_percent(curve[step], against[step])))
    return {step: sorted(seeds, key=lambda seed: (seed[0].endswith("g"), int(seed[0].rstrip("g"))))
            for step, seeds in gaps.items()}


def judged_lr(runs: list[dict], batch: str) -> str:
    """The lr every method is judged at at ``batch``: plain's best, or 1e-3 before plain has finished a run there."""
    return best_lr(runs, batch) or "1e-3"


def decisions(runs: list[dict], batch: str) -> list[dict]:
    """Per method of the decision set, at plain's best lr at ``batch`` (1e-3 until the sweep has finished seeds):
    one row per evaluation step with the seeds' gaps, their mean and its 95% interval, and the verdict. A method
    whose own finished runs do best at another lr gets its rows there too, against plain at plain's best (their
    ``lr``: ``"own 2e-3"``)."""
    lr = judged_lr(runs, batch)
    out = []
    for method in METHODS:
        if method == "plain":
            continue
        own = best_lr(runs, batch, method)
        for at in [lr, *([own] if own not in (None, lr) else [])]:
            out += _rows(method, batch, lr if at == lr else f"own {at}", pairs(runs, method, batch, at, lr))
    return out


def ablations(runs: list[dict], batch: str) -> list[dict]:
    """Per :data:`ABLATIONS` entry, at plain's best lr at ``batch``: one row per evaluation step with each seed's
    gap of the method over its variant that leaves one setting out, their mean, interval and verdict (*ahead*:
    the setting lowers the loss)."""
    lr = judged_lr(runs, batch)
    return [{**row, "method": f"{method} over {variant}"} for method, variant in ABLATIONS.items()
            for row in _rows(method, batch, lr, pairs(runs, method, batch, lr, base=variant))]


def off_best(runs: list[dict], batch: str) -> list[dict]:
    """Per method, the last evaluation of its pairs with plain at the same lr where that lr is not plain's best at
    ``batch`` nor a method's own best that :func:`decisions` shows: a record of what was measured there before
    the sweep moved plain's best, not a decision."""
    lr = judged_lr(runs, batch)
    shown = {(row["method"], row["lr"].removeprefix("own ")) for row in decisions(runs, batch)}
    out = []
    for method in METHODS:
        rates = {r["lr"] for r in runs if r["method"] == method and r["batch"] == batch} - {lr}
        for at in sorted(rates, key=float):
            if method != "plain" and (method, at) not in shown:
                out += _rows(method, batch, at, pairs(runs, method, batch, at))[-1:]
    return out


def _rows(method: str, batch: str, label: str, by_step: dict[int, list[tuple[str, float]]]) -> list[dict]:
    """One decision row per evaluation step of ``by_step`` (:func:`pairs`' gaps)."""
    out = []
    for step, gaps in sorted(by_step.items()):
        mean, low, high = t_interval([g for _, g in gaps])
        untuned = [g for seed, g in gaps if int(seed.rstrip("g")) not in TUNED_ON.get(method, ())]
        out.append({"method": method, "batch": batch, "lr": label, "step": step, "seeds": [s for s, _ in gaps],
                    "gaps": [g for _, g in gaps], "mean": mean, "low": low, "high": high,
                    "verdict": verdict(low, high), "untuned": _untuned(method, untuned)})
    return out


def _series(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """:func:`decisions`' rows by ``(method, lr)``, in their order."""
    out: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        out.setdefault((row["method"], row["lr"]), []).append(row)
    return out


def _untuned(method: str, gaps: list[float]) -> str:
    """The verdict over the seeds ``method``'s settings were not picked on (:data:`TUNED_ON`), in words."""
    if method not in TUNED_ON:
        return "(not tuned)"
    if not gaps:
        return "none yet"
    mean, low, high = t_interval(gaps)
    return f"{len(gaps)}: {_pct(mean)} [{_pct(low)}, {_pct(high)}], {verdict(low, high)}"


def batch_axis(runs: list[dict]) -> list[dict]:
    """The decision rows at each batch's last evaluation (its schedule's end, so every batch has read the same
    tokens), each with its ``tokens_per_step``: the gap against the batch."""
    return [{**row, "tokens_per_step": tokens_per_step(batch)} for batch in BATCHES
            for row in decisions(runs, batch) if row["step"] == schedule(batch)[0] - 1
            and not row["lr"].startswith("own")]


def doubling_line(points: Sequence[dict]) -> Optional[tuple[float, float]]:
    """``(gap at GPT-2's tokens per step, points per doubling)``: the least-squares line of ``points``' mean gaps
    (one method's :func:`batch_axis` rows) against log2 of their tokens per step, carried to
    :data:`GPT2_TOKENS_PER_STEP`; None under two batches. Means only: the line has no interval."""
    if len({p["tokens_per_step"] for p in points}) < 2:
        return None
    slope, intercept = statistics.linear_regression([math.log2(p["tokens_per_step"]) for p in points],
                                                    [p["mean"] for p in points])
    return intercept + slope * math.log2(GPT2_TOKENS_PER_STEP), slope


def render_batch_axis(runs: list[dict]) -> list[str]:
    """Per method, what its gap against the batch implies at GPT-2's tokens per step (lines of markdown)."""
    points = batch_axis(runs)
    lines = []
    for method in METHODS:
        mine = [p for p in points if p["method"] == method]
        if not mine:
            continue
        measured = ", ".join(f"{p['tokens_per_step']:,}: {_pct(p['mean'])} [{_pct(p['low'])}, {_pct(p['high'])}] "
                             f"(seed{'s' * (len(p['seeds']) > 1)} {','.join(p['seeds'])})" for p in mine)
        line = doubling_line(mine)
        implied = ("one batch measured: no slope yet" if line is None else
                   f"{line[1]:+.2f} points per doubling; a line through the means reads {line[0]:+.2f}% at GPT-2's "
                   f"{GPT2_TOKENS_PER_STEP:,} tokens per step (an extrapolation, without an interval)")
        lines.append(f"- {METHODS[method][0]}: mean gap at the last evaluation by tokens per step, {measured}; "
                     f"{implied}.")
    return lines or ["- no batch has a finished pair yet."]


def _cells(row: dict) -> str:
    """A decision row (:func:`_rows`) as a markdown table row, up to its verdict."""
    return (f"| {row['batch']} | {row['method']} | {row['lr']} | {row['step'] + 1} | {','.join(row['seeds'])} | "
            f"{', '.join(f'{g:+.2f}' for g in row['gaps'])} | {_pct(row['mean'])} | "
            f"[{_pct(row['low'])}, {_pct(row['high'])}] | {row['verdict']} |")


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.2f}%"


def render_report(runs: list[dict]) -> str:
    """``docs/evidence.md``: the sweep, every decision at every evaluation, and what each run has done."""
    lines = ["# The loss evidence", "", "Generated by `python -m gpt2_bench.evidence rebuild` from the curve files in",
             "`docs/rows/evidence/`: do not edit by hand. The protocol is in the docstring of",
             "`gpt2_bench.evidence`; each run's file holds its command, commit, torch version and machine. A CPU",
             "run pairs only with plain on a machine that computes alike: its file name ends in that machine's",
             "numerics fingerprint (`-cpu-...`; none for the runs made before fingerprints, on one machine).", "",
             "To add runs: `python -m gpt2_bench.evidence queue` on a CPU (the unfinished runs in order, resumable;",
             "`queue --list` shows them, how far each is and a method's gap to plain so far, before it is kept;",
             "preloading jemalloc that never returns memory,",
             "`LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1`, spares the page faults",
             "that glibc takes on the large blocks of every step, with the same losses bit for bit),",
             "`.gpu/quality.sh` on a lent GPU (six runs at once; 16x: plain's sweep, then seeds at its best lr;",
             "all back in one `quality.tar`; its `-gpu` files pair only with each other); then copy the curve files",
             "here and run the rebuild. A verdict is the 95% t-interval of the paired mean gap:",
             "*within X%* when its upper end is below X, a *tie* when it holds 0.", "",
             "![the gap against tokens read, per batch, and against tokens per step](img/evidence-gap.png)", "",
             "## Plain's learning rate", "",
             "*Best*: the lowest mean last val loss over the seeds finished at every lr of the batch. A best at",
             "either end of the rates run is bracketed next: the queue runs the rate one doubling past it.", "",
             "| batch | lr | runs finished | their platforms | mean last val loss, all its runs |",
             "|---|---|---:|---|---:|"]
    for batch in BATCHES:
        for lr in sorted({r["lr"] for r in runs if r["method"] == "plain" and r["batch"] == batch}, key=float):
            done = [r for r in runs if r["method"] == "plain" and r["batch"] == batch and r["lr"] == lr and complete(r)]
            if done:
                mean = sum(r["val_loss"][-1][1] for r in done) / len(done)
                best = " (best)" if lr == best_lr(runs, batch) else ""
                platforms = ", ".join(sorted({r.get("platform", "cpu") for r in done}))
                lines.append(f"| {batch} | {lr}{best} | {len(done)} | {platforms} | {mean:.4f} |")
    if lines[-1].startswith("|---"):
        lines.append("| (no finished plain run yet) | | | | |")
    lines += ["", "## Decisions", "",
              "Gap: the method's val loss against plain's of the same seed, in %; the interval is the 95% t-interval "
              "of the mean over seeds. *Untuned seeds*: the same over the seeds the method's settings were not "
              "picked on (`TUNED_ON` in `gpt2_bench.evidence`): their count, mean [interval] and verdict.", "",
              *_verdicts("method", [row for batch in BATCHES for row in decisions(runs, batch)])]
    lines += ["", "## What a setting buys", "",
              "A method against the same method with one setting left out or on two ranks (`ABLATIONS` in "
              "`gpt2_bench.evidence`), on the same seed, machine and lr: the gap is the method's val loss over the "
              "variant's, in %; *ahead* means the setting lowers the loss, a *tie* that the seeds cannot tell.", "",
              *_verdicts("method over variant", [row for batch in BATCHES for row in ablations(runs, batch)])]
    lines += ["", "## Pairs at a rate that is not plain's best", "",
              "A method paired with plain at the same lr, where that lr is not plain's best at its batch (the sweep "
              "moved the best after these runs, or the method tried a rate of its own): their last evaluation, a "
              "record and not a verdict on the method; the queue runs the method at plain's best.", "",
              "| batch | method | lr | step | seeds | gaps | mean | 95% interval | at that lr |",
              "|---|---|---|---:|---|---|---:|---|---|"]
    for batch in BATCHES:
        lines += [_cells(row) for row in off_best(runs, batch)]
    if lines[-1].startswith("|---"):
        lines.append("| (none) | | | | | | | | |")
    lines += ["", "## The batch axis", "",
              "Each method's gap at the end of each batch's schedule (the same tokens read), against tokens per step "
              "(the plot's last panel):",
              "", *render_batch_axis(runs)]
    lines += ["", "## One run on two machines", "",
              "The same run (method, seed, batch, lr) finished on CPUs of different numerics fingerprints: the "
              "second's val loss against the first's, in %, at each evaluation. Machines that differ in the last "
              "bits of their arithmetic can still give one plain run alike; a compressed run amplifies such a "
              "difference (its selection is discontinuous: [a protocol check](quality-diagnosis.md#a-protocol-"
              "check-a-resumes-uncompressed-step-and-how-far-one-step-moves-a-compressed-run)), so a pair is made "
              "on one machine.", "",
              *render_machines(runs)]
    lines += ["", "## The runs", "", "*MB per step*: the median of what a step sent per rank (the trainer's "
              "`wire_bytes`; a dash where the run's log was not at hand when its file was kept). *Uncompressed "
              "resumes*: steps after step 0 that a method's run exchanged uncompressed, one per resume made before "
              "the trainer settled DDP's buckets first (2026-12-03; the runs then resumed at every evaluation; "
              "`unsettled_resumes` in `gpt2_bench.evidence`). Such a run is a record; where a seed has a run made in "
              "one process beside it, that run takes the seed's place in the verdicts.", "",
              "| batch | run | seed | steps done | epoch read | MB per step | uncompressed resumes | machine | torch "
              "| commit |",
              "|---|---|---:|---|---:|---:|---:|---|---|---|"]
    for r in runs:
        session = r["sessions"][-1] if r["sessions"] else {}
        machine = session.get("machine", {})
        epoch = "-" if r["epoch_fraction"] is None else f"{r['epoch_fraction']:.2f}"
        name = run_name(r["method"], r["lr"], r.get("platform", "cpu"))
        wire = "-" if r.get("wire_mb_per_step") is None else f"{r['wire_mb_per_step']:.2f}"
        lines.append(f"| {r['batch']} | {name} | {r['seed']} | {r['steps_done']} of "
                     f"{r['steps']} | {epoch} | {wire} | {unsettled_resumes(r)} | {machine.get('host', '?')} "
                     f"({machine.get('cores', '?')} cores"
                     f"{', ' + machine['gpu'] if machine.get('gpu') else ''}) | {session.get('torch', '?')} | "
                     f"{session.get('commit', '?')[:12]} |")
    return "\n".join(lines) + "\n"


def _verdicts(method_column: str, rows: list[dict]) -> list[str]:
    """A markdown table of decision rows (:func:`_rows`), each with its untuned seeds' verdict."""
    return [f"| batch | {method_column} | lr | step | seeds | gaps | mean | 95% interval | verdict | untuned seeds |",
            "|---|---|---|---:|---|---|---:|---|---|---|",
            *([f"{_cells(row)} {row['untuned']} |" for row in rows] or ["| (no paired runs yet) | | | | | | | | | |"])]


def render_machines(runs: list[dict]) -> list[str]:
    """Lines of markdown: per run finished on two or more CPU platforms, each later platform's val loss against
    the first's (in name order) at every evaluation."""
    groups: dict[tuple[str, int, str, str], list[dict]] = {}
    for r in sorted(runs, key=lambda r: r.get("platform", "cpu")):
        if on_cpu(r) and complete(r):
            groups.setdefault((r["method"], r["seed"], r["batch"], r["lr"]), []).append(r)
    lines = []
    for (method, seed, batch, lr), (first, *others) in sorted(groups.items()):
        for other in others:
            mine = dict(map(tuple, other["val_loss"]))
            gaps = ", ".join(f"{step + 1}: {gap_percent(mine[step], loss):+.3f}%" for step, loss in first["val_loss"]
                             if step in mine)
            lines.append(f"- {method} seed {seed} {batch} lr {lr}, {other['platform']} against "
                         f"{first.get('platform', 'cpu')}: {gaps}.")
    return lines or ["- none yet."]


def render_readme(runs: list[dict]) -> str:
    """The README's quality block: per method, its last evaluation at each batch with each seed's gap and a
    verdict; then the plot."""
    lines = [README_BEGIN, "| method | batch | step | gap per seed | mean gap to plain [95% interval] | verdict | "
             "untuned seeds |", "|---|---|---:|---|---|---|---|"]
    for batch in BATCHES:
        rows = decisions(runs, batch)
        for (method, lr), mine in _series(rows).items():
            last = mine[-1]
            name = METHODS[method][0] + (f" at its own best lr, {lr[4:]}" if lr.startswith("own") else "")
            per_seed = ", ".join(f"{gap:+.2f}% ({seed})" for seed, gap in zip(last["seeds"], last["gaps"]))
            lines.append(f"| {name} | {batch} | {last['step'] + 1} | {per_seed} | "
                         f"{_pct(last['mean'])} [{_pct(last['low'])}, {_pct(last['high'])}] | {last['verdict']} | "
                         f"{last['untuned']} |")
    if len(lines) == 3:
        lines.append("| (no paired runs kept yet) | | | | | | |")
    lines += ["", "![each method's gap to plain against tokens read per batch (seeds dashed), and against tokens per "
              "step](docs/img/evidence-gap.png)", "", "Against tokens per step (the plot's last panel):", "",
              *render_batch_axis(runs)]
    return "\n".join([*lines, README_END])


def plot(runs: list[dict], path: Path) -> None:
    """Per batch, each method's mean gap against the tokens read, its 95% interval as a band (cut at the seeds'
    gaps: with two seeds it is wide) and each seed's gap dashed; last, each method's gap at each batch's end against
    tokens per step (log scale), each seed's as a cross, its :func:`doubling_line` dashed to GPT-2's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BATCHES) + 1, figsize=(16, 4))
    colour = {method: f"C{k % 10}" for k, method in enumerate(METHODS)}  # alike in every panel and at a method's lr
    for ax, batch in zip(axes, BATCHES):
        shown = [0.0]  # what the panel spans: zero, the means and every seed's gap
        for (method, lr), mine in _series(decisions(runs, batch)).items():
            shown += [g for r in mine for g in (r["mean"], *r["gaps"])]
            tokens = [(r["step"] + 1) * tokens_per_step(batch) / 1e6 for r in mine]
            label = f"{method} ({lr})" if lr.startswith("own") else method
            (line,) = ax.plot(tokens, [r["mean"] for r in mine], marker="s" if lr.startswith("own") else "o",
                              label=label, color=colour[method])
            ax.fill_between(tokens, [r["low"] for r in mine], [r["high"] for r in mine], color=line.get_color(),
                            alpha=0.08)
            for seed in dict.fromkeys(seed for r in mine for seed in r["seeds"]):
                gaps = [(t, g) for t, r in zip(tokens, mine) for s, g in zip(r["seeds"], r["gaps"]) if s == seed]
                ax.plot(*zip(*gaps), color=line.get_color(), lw=1, ls="--", alpha=0.7)
        if not ax.lines:
            ax.text(0.5, 0.5, "no finished pair yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        else:
            margin = max(0.5, 0.15 * (max(shown) - min(shown)))
            ax.set_ylim(min(shown) - margin, max(shown) + margin)
        ax.set(title=f"{batch} ({tokens_per_step(batch):,} tokens per step)", xlabel="tokens read (M)")
    axes[0].set_ylabel("val loss against plain, same seed (%)\nbands: 95% intervals, cut at the seeds' range")
    ax, points = axes[-1], batch_axis(runs)
    for method in METHODS:
        mine = [p for p in points if p["method"] == method]
        if mine:
            xs, ys = [p["tokens_per_step"] for p in mine], [p["mean"] for p in mine]
            spread = [[0 if math.isnan(p["low"]) else p["mean"] - p["low"] for p in mine],
                      [0 if math.isnan(p["high"]) else p["high"] - p["mean"] for p in mine]]
            bars = ax.errorbar(xs, ys, yerr=spread, marker="o", capsize=3, label=method, color=colour[method])
            ax.plot([p["tokens_per_step"] for p in mine for _ in p["gaps"]], [g for p in mine for g in p["gaps"]],
                    "x", color=bars[0].get_color(), alpha=0.7)
            if (line := doubling_line(mine)) is not None:
                ax.plot([xs[-1], GPT2_TOKENS_PER_STEP], [ys[-1], line[0]], ls="--", color=bars[0].get_color())
    ax.axvline(GPT2_TOKENS_PER_STEP, color="grey", ls=":", lw=1)
    ax.text(GPT2_TOKENS_PER_STEP, ax.get_ylim()[1], "GPT-2", ha="right", va="top", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set(title="at each batch's end", xlabel="tokens per step (dashed: extrapolated)")
    for ax in axes:
        ax.axhline(0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rebuild(rows_dir: Path = ROWS) -> None:
    """Remake ``docs/evidence.md``, its plot and the README's quality block from the kept curve files."""
    runs = load(rows_dir)
    REPORT.write_text(render_report(runs))
    plot(runs, PLOT)
    text = README.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md has no {README_BEGIN} ... {README_END} block")
    README.write_text(text[:begin] + render_readme(runs) + text[end + len(README_END):])
