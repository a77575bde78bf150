"""The quality protocol: each method against plain FSDP over several seeds, with the noise stated.

A seed changes the model's initialisation and the order of the training windows (and the val
windows drawn). Two runs of the same method that differ only in the seed part by about as
much as the methods being judged, so a gap to plain means something only beside the
seed-to-seed spread. For every method and evaluation step this module gives:

- the **mean gap**: the mean over seeds of the method's val loss against plain's *of the same
  seed* (paired: both saw the same initialisation and windows), in percent;
- the **spread** of plain and of the method: the range (largest minus smallest) of its val
  loss over the seeds, in percent of its mean;
- the verdict: a **tie** when the mean gap is smaller than the larger of the two spreads,
  otherwise ahead or behind. One seed states no spread and calls nothing a tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gpt2_bench.methods import PLAIN_METHOD


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``: distinct integers, in order; a clear error otherwise."""
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, e.g. 0,1; got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs distinct integers, e.g. 0,1; got {text!r}")
    return seeds


def _evals(result: dict) -> dict[int, float]:
    return {c["step"]: c["val_loss"] for c in result.get("curve", []) if c.get("val_loss") is not None}


def _spread(values: Sequence[float]) -> float | None:
    """Range over seeds in percent of the mean; None for fewer than two seeds."""
    if len(values) < 2:
        return None
    return 100 * (max(values) - min(values)) / (sum(values) / len(values))


def seed_gaps(by_seed: dict[int, dict[str, dict]]) -> dict[str, list[dict]]:
    """Per method (plain's own rows included, gap 0), one row per evaluation step that every seed's
    plain run and the method's evaluated: the mean val losses, the mean paired gap, both spreads and
    the verdict (see the module's docstring)."""
    seeds = sorted(by_seed)
    if any(PLAIN_METHOD not in by_seed[s] for s in seeds):
        raise ValueError(f"every seed needs a {PLAIN_METHOD!r} run to compare against")
    methods = list(dict.fromkeys(m for s in seeds for m in by_seed[s]))
    plain = {s: _evals(by_seed[s][PLAIN_METHOD]) for s in seeds}
    out: dict[str, list[dict]] = {}
    for method in methods:
        if any(method not in by_seed[s] for s in seeds):
            continue  # a method missing a seed is not compared on unequal footing
        mine = {s: _evals(by_seed[s][method]) for s in seeds}
        steps = sorted(set.intersection(*(set(mine[s]) & set(plain[s]) for s in seeds)))
        rows = []
        for step in steps:
            ours, theirs = [mine[s][step] for s in seeds], [plain[s][step] for s in seeds]
            gap = 100 * sum(o / p - 1 for o, p in zip(ours, theirs)) / len(seeds)
            plain_spread, spread = _spread(theirs), _spread(ours)
            noise = None if plain_spread is None else max(plain_spread, spread)
            verdict = (
                None
                if noise is None or method == PLAIN_METHOD
                else ("tie" if abs(gap) < noise else "behind" if gap > 0 else "ahead")
            )
            rows.append(
                {
                    "step": step,
                    "seeds": len(seeds),
                    "plain": sum(theirs) / len(seeds),
                    "val_loss": sum(ours) / len(seeds),
                    "gap": gap,
                    "gaps": [100 * (o / p - 1) for o, p in zip(ours, theirs)],
                    "plain_spread": plain_spread,
                    "spread": spread,
                    "noise": noise,
                    "verdict": verdict,
                }
            )
        out[method] = rows
    return out


def mean_quality(by_seed: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """Per method, its val loss averaged over the seeds (the methods report's column), with the
    first seed's curve and the run length; only methods run at every seed."""
    seeds = sorted(by_seed)
    methods = [m for m in dict.fromkeys(m for s in seeds for m in by_seed[s]) if all(m in by_seed[s] for s in seeds)]
    return {
        m: {
            **by_seed[seeds[0]][m],
            "val_loss": sum(by_seed[s][m]["val_loss"] for s in seeds) / len(seeds),
            "seeds": list(seeds),
        }
        for m in methods
    }


def format_seeds_report(
    by_seed: dict[int, dict[str, dict]],
    steps: int,
    plateau: float | None = None,
    tokens_per_step: int | None = None,
    tolerance: float = 0.01,
    plain_label: str = PLAIN_METHOD,
) -> str:
    """The quality runs over seeds as Markdown: per method a table of every evaluation step (mean
    val loss, mean gap to plain, both spreads, verdict), then one line per method on the last step
    and on whether it stays within ``tolerance`` of plain from the first evaluation past 20% of the run.
    ``plain_label``: the name the report gives the run filed as plain (e.g. a control run)."""
    gaps = seed_gaps(by_seed)
    seeds = sorted(by_seed)

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    head = f"# GPT-2: val loss of the quality runs ({steps} steps, unshaped, seeds {', '.join(map(str, seeds))})"
    lines = [head, ""]
    if tokens_per_step:
        lines += [f"{tokens_per_step:,} tokens per step (all ranks), {steps * tokens_per_step:,} in a run.", ""]
    lines += [
        f"Gap: the method's val loss against {plain_label}'s of the same seed, averaged over seeds. Spread: the "
        f"range of a method's val loss over seeds, in % of its mean. A gap smaller than the larger spread "
        f"(plain's or the method's) is a tie."
        + (" One seed: no spread, so no tie is called." if len(seeds) < 2 else ""),
        "",
    ]
    plain_rows = gaps.get(PLAIN_METHOD, [])
    if plateau is not None and plain_rows:
        end = plain_rows[-1]["plain"]
        lines += [
            (f"Unigram plateau (val tokens under the train split's token frequencies): {plateau:.4f}; {plain_label} "
             f"ends at {end:.4f} (mean over seeds), {abs(plateau - end):.2f} nats "
             f"{'below' if end < plateau else 'above'} "
             f"it. Methods part only past it."),
            "",
        ]
    for method, rows in gaps.items():
        if method == PLAIN_METHOD or not rows:
            continue
        lines += [
            f"## `{method}`",
            "",
            (f"| step | {plain_label} | {method} | gap | per seed | {plain_label} spread | "
             f"{method} spread | verdict |"),
            "|---:|---:|---:|---:|---|---:|---:|---|",
        ]
        for row in rows:
            per_seed = ", ".join(f"{g:+.2f}" for g in row["gaps"])
            lines.append(
                f"| {row['step']} | {row['plain']:.4f} | {row['val_loss']:.4f} | {row['gap']:+.2f}% | {per_seed} | "
                f"{fmt(row['plain_spread'], '.2f')}% | {fmt(row['spread'], '.2f')}% | {row['verdict'] or '-'} |"
            )
        lines.append("")
    lines += ["## Verdicts", ""]
    for method in dict.fromkeys(m for runs in by_seed.values() for m in runs):
        missing = [str(seed) for seed in seeds if method not in by_seed[seed]]
        if missing and method != PLAIN_METHOD:
            lines.append(f"- `{method}`: not compared: no run for seed {', '.join(missing)} (every seed needs one; "
                         "`--seeds` picks the seeds to report)")
    for method, rows in gaps.items():
        if method == PLAIN_METHOD or not rows:
            continue
        last = rows[-1]
        judged = [row for row in rows if row["step"] + 1 >= steps // 5]
        outside = [row for row in judged if row["gap"] > 100 * tolerance]
        since = judged[0]["step"] if judged else "-"
        if outside:
            worst = max(outside, key=lambda row: row["gap"])
            judgement = (f"mean gap outside {100 * tolerance:g}% at {len(outside)} of {len(judged)} evaluations "
                         f"from step {since} on (largest {worst['gap']:+.2f}% at step {worst['step']}).")
        else:
            judgement = f"mean gap within {100 * tolerance:g}% at every evaluation from step {since} on."
        unfinished = (f" Not finished: every seed's runs reach step {last['step']} of {steps}, so this judges "
                      "that far." if last["step"] + 1 < steps else "")
        lines.append(
            f"- `{method}`: {last['gap']:+.2f}% at step {last['step']} "
            + (f"(noise {last['noise']:.2f}%: {last['verdict']}); " if last["verdict"] else "(one seed); ")
            + judgement + unfinished
        )
    return "\n".join(lines) + "\n"


def plot_seed_gaps(by_seed: dict[int, dict[str, dict]], path, plain_label: str = PLAIN_METHOD) -> None:
    """Each method's mean gap to plain (named ``plain_label`` on the axis) against step, with a band of +- the
    larger spread (the noise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method, rows in seed_gaps(by_seed).items():
        if method == PLAIN_METHOD or not rows:
            continue
        steps = [r["step"] for r in rows]
        (line,) = ax.plot(steps, [r["gap"] for r in rows], marker="o", label=method)
        noise = [r["noise"] for r in rows]
        if all(n is not None and not math.isnan(n) for n in noise):
            ax.fill_between(
                steps,
                [r["gap"] - n for r, n in zip(rows, noise)],
                [r["gap"] + n for r, n in zip(rows, noise)],
                color=line.get_color(),
                alpha=0.15,
            )
    ax.axhline(0, color="black", lw=0.8)
    ax.set(
        xlabel="step",
        ylabel=f"val loss vs {plain_label} of the same seed (%)",
        title="mean gap over seeds, band: +- the seed-to-seed spread",
    )
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no method has a run for every seed", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _trainer_logs(directory, wanted=lambda name: True):
    """Every trainer log ``directory/seed-N/<name>.jsonl`` (diagnostics logs aside) whose ``name`` is ``wanted`` and
    that holds an evaluation: ``(seed folder, name, its records, [(step, val loss), ...])``, in order."""
    import json
    from pathlib import Path

    for folder in sorted(Path(directory).glob("seed-*")):
        for log in sorted(folder.glob("*.jsonl")):
            name = log.name.removesuffix(".jsonl")
            if name.endswith(".diagnostics") or not wanted(name):
                continue
            records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            evaluations = [(r["step"], r["val_loss"]) for r in records if "step" in r and r.get("val_loss") is not None]
            if evaluations:
                yield folder.name, name, records, evaluations


def read_runs(directory, methods: Sequence[str] = (), plain: str = PLAIN_METHOD) -> dict[int, dict[str, dict]]:
    """``directory/seed-N/<method>.jsonl`` (the trainer's logs) -> ``{seed: {method: {"curve", "val_loss"}}}``,
    the shape :func:`seed_gaps` reads; ``plain`` names the run every method is compared against (it is
    filed as :data:`PLAIN_METHOD`), ``methods`` keeps only those (default: every log found).

    A run that followed another schedule than its seed's plain run (another learning rate or number of
    tokens at a step both logged: a 600-step run beside a 2,000-step one, another batch) is left out with a
    warning: its val loss at a shared step is not comparable."""
    import warnings

    by_seed: dict[int, dict[str, dict]] = {}
    schedules: dict[tuple[int, str], dict] = {}  # (seed, run) -> {step: (lr, tokens)}, for the check below
    wanted = (lambda name: name in methods or name == plain) if methods else (lambda name: True)
    for folder, name, records, evaluations in _trainer_logs(directory, wanted):
        seed, key = int(folder.removeprefix("seed-")), _label(name, plain)
        curve = [{"step": step, "val_loss": loss} for step, loss in evaluations]
        schedules[seed, key] = {r["step"]: (r.get("lr"), r.get("tokens")) for r in records if "step" in r}
        by_seed.setdefault(seed, {})[key] = {"curve": curve, "val_loss": curve[-1]["val_loss"]}
    if not by_seed:
        raise FileNotFoundError(f"no seed-N/<method>.jsonl logs with evaluations under {directory}")
    for seed, runs in by_seed.items():
        reference = schedules.get((seed, PLAIN_METHOD), {})
        for key in [k for k in runs if k != PLAIN_METHOD]:
            step = _first_schedule_difference(reference, schedules[seed, key])
            if step is not None:
                warnings.warn(f"seed-{seed}/{key}.jsonl left out: at step {step} its (lr, tokens) "
                              f"{schedules[seed, key][step]} differ from {plain}'s {reference[step]} (another "
                              "schedule or batch; run it with the same --steps, --batch-size and --lr)", stacklevel=2)
                del runs[key]
    return by_seed


def read_rows(paths: Sequence, methods: Sequence[str] = (), plain: str = PLAIN_METHOD) -> dict[int, dict[str, dict]]:
    """Curves kept in the repository (``docs/rows/gpu-quality-*.json``: ``{"runs": {"seed-N/<method>": {"val_loss":
    [[step, loss], ...]}}}``) -> what :func:`read_runs` gives for trainer logs, so a report of runs whose logs stayed
    on the machine that made them can be made again. A run in a later file replaces the same run of an earlier one.
    The files hold no learning rates, so the schedule check of :func:`read_runs` is not made: keep only runs of one
    protocol in the files you combine."""
    import json
    from pathlib import Path

    by_seed: dict[int, dict[str, dict]] = {}
    for path in paths:
        runs = json.loads(Path(path).read_text()).get("runs")
        if not isinstance(runs, dict):
            raise ValueError(f"{path} has no \"runs\" object of \"seed-N/<method>\" curves")
        for key, run in runs.items():
            folder, _, name = key.partition("/")
            if not folder.startswith("seed-") or not name:
                raise ValueError(f"{path}: run {key!r} is not named seed-N/<method>")
            if methods and name not in methods and name != plain:
                continue
            curve = [{"step": int(step), "val_loss": float(loss)} for step, loss in run.get("val_loss", [])]
            if curve:
                by_seed.setdefault(int(folder.removeprefix("seed-")), {})[_label(name, plain)] = {
                    "curve": curve, "val_loss": curve[-1]["val_loss"]}
    if not by_seed:
        raise FileNotFoundError(f"no seed-N/<method> curves in {', '.join(map(str, paths))}")
    return by_seed


def save_rows(directory, path, machine: str, protocol: str) -> dict:
    """The val-loss curves of every trainer log under ``directory/seed-N/`` -> a curve file for ``docs/rows`` (the
    format :func:`read_rows` reads), so a report can be made again after the machine that ran the logs is gone.
    Runs keep their own names (plain's included); ``machine`` and ``protocol`` say where and how they ran."""
    import json
    from pathlib import Path

    runs = {f"{folder}/{name}": {"val_loss": [list(evaluation) for evaluation in evaluations]}
            for folder, name, _, evaluations in _trainer_logs(directory)}
    if not runs:
        raise FileNotFoundError(f"no seed-N/<method>.jsonl logs with evaluations under {directory}")
    rows = {"machine": machine, "protocol": protocol, "runs": runs}
    Path(path).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _label(name: str, plain: str) -> str:
    """A run's key in the report: :data:`PLAIN_METHOD` for ``plain``, the run's own name otherwise (renamed when it is
    that name without being the plain run)."""
    return PLAIN_METHOD if name == plain else (name if name != PLAIN_METHOD else f"{name} (not plain)")


def _first_schedule_difference(plain: dict, run: dict) -> int | None:
    """The first step both logged whose learning rate (relatively, beyond float rounding) or token count differs."""
    for step in sorted(set(plain) & set(run)):
        (lr_a, tokens_a), (lr_b, tokens_b) = plain[step], run[step]
        if tokens_a is not None and tokens_b is not None and tokens_a != tokens_b:
            return step
        if lr_a is not None and lr_b is not None and not math.isclose(lr_a, lr_b, rel_tol=1e-6, abs_tol=1e-12):
            return step
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpt2_bench.quality DIR``: the seeds report of trainer logs laid out as ``DIR/seed-N/<method>.jsonl``
    (e.g. runs made one by one with ``python -m gpt2_bench.train --seed N --out-dir DIR/seed-N``), written to
    ``DIR/quality.md`` (or ``--out``) with its gap plot beside it."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m gpt2_bench.quality", description=main.__doc__)
    parser.add_argument("directory", nargs="?", default=None,
                        help="the logs, DIR/seed-N/<method>.jsonl (or give --rows, or both)")
    parser.add_argument("--rows", default=None,
                        help="comma-separated curve files kept in the repository, e.g. "
                             "docs/rows/gpu-quality-2026-11-27.json,docs/rows/gpu-quality-2026-11-27-fifth.json "
                             "(a run in a later file replaces the same run of an earlier one, and a run logged in "
                             "the directory replaces both: new runs beside the plain runs kept there)")
    parser.add_argument("--plain", default=PLAIN_METHOD, help="the run every method is compared against (default fsdp)")
    parser.add_argument("--methods", default="", help="comma-separated runs to report (default: every log)")
    parser.add_argument("--steps", type=int, default=None, help="the runs' length (default: the last evaluation + 1)")
    parser.add_argument("--out", default=None, help="the report's path (default DIR/quality.md)")
    parser.add_argument("--tolerance", type=float, default=1.0,
                        help="the verdicts' bound on the mean gap, in percent (default 1, e.g. 0.5)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds to report (default: every seed-N found)")
    parser.add_argument("--save-rows", default=None, metavar="FILE",
                        help="also write every log's val-loss curve to FILE, a curve file for docs/rows that --rows "
                             "reads back (give --machine and --protocol with it)")
    parser.add_argument("--machine", default=None, help="with --save-rows: where the runs ran (CPU, card, torch)")
    parser.add_argument("--protocol", default=None, help="with --save-rows: the command the runs share")
    args = parser.parse_args(argv)
    if args.save_rows is not None and (args.directory is None or not args.machine or not args.protocol):
        parser.error("--save-rows keeps the logs of the directory: give the directory, --machine and --protocol")
    if not 0 < args.tolerance < 100:
        parser.error(f"--tolerance is a percentage in (0, 100), e.g. 1 or 0.5; got {args.tolerance}")
    if args.directory is None and args.rows is None:
        parser.error("give the logs' directory, --rows, or both")
    if args.directory is None and args.out is None:
        parser.error("--rows without a directory: give --out, the report's path (a PNG plot goes beside it)")
    methods = [m for m in args.methods.split(",") if m]
    by_seed = read_rows([p for p in args.rows.split(",") if p], methods, args.plain) if args.rows is not None else {}
    if args.save_rows is not None:
        save_rows(args.directory, args.save_rows, args.machine, args.protocol)
    if args.directory is not None:  # a run logged there replaces the same run of the rows
        for seed, runs in read_runs(args.directory, methods, args.plain).items():
            by_seed.setdefault(seed, {}).update(runs)
    if args.seeds is not None:
        wanted = parse_seeds(args.seeds)
        if not set(wanted) <= set(by_seed):
            parser.error(f"--seeds {args.seeds}: no logs for seed {sorted(set(wanted) - set(by_seed))} "
                         f"(found {sorted(by_seed)})")
        by_seed = {seed: by_seed[seed] for seed in wanted}
    steps = args.steps or 1 + max(c["step"] for runs in by_seed.values() for run in runs.values() for c in run["curve"])
    out = Path(args.out or Path(args.directory) / "quality.md")
    report = format_seeds_report(by_seed, steps, tolerance=args.tolerance / 100, plain_label=args.plain)
    out.write_text(report)
    plot_seed_gaps(by_seed, out.with_suffix(".png"), plain_label=args.plain)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
