"""Codec benchmark: throughput on this CPU (reference, and the Numba kernels beside it) and the peeling success curve.

``python -m tagc.bench codec [--sizes 1M,16M] [--json out.json] [--plot out.png] [--quick]``

Throughput is in GB/s of fp32 input, the median of ``--repeats`` runs after a warm-up,
and each op is also given as a multiple of a ``torch.clone`` of the same buffer (fresh
memory, page faults included) and of a ``copy_`` into a preallocated one (warm memory).
The peeling curve decodes random supports at a sweep of loads (union non-zeros per row
of a lane) and counts how often, and how much of, the support is recovered exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
from tqdm import tqdm

from tagc.sketch import (
    PEELING_THRESHOLD,
    PLANNED_LOAD,
    SketchLayout,
    build_index,
    compress_,
    decode,
    encode,
    merge_index,
    plan_density,
    split_kept,
)

DEFAULT_SIZES = "1M,4M,16M,64M"
QUICK_SIZES = "64K"
DEFAULT_PEEL_SIZES = "1M,16K"
QUICK_PEEL_SIZES = "4K"
DEFAULT_LOADS = (0.5, 0.6, 0.65, 0.7, 0.74, 0.76, 0.77, 0.78, 0.79, 0.8, 0.81, 0.82, 0.84, 0.87, 0.9, 0.95)
QUICK_LOADS = (0.5, 0.7, 0.9)
TARGET_NUMEL = 16 << 20
TARGETS = {"compress": 4.0, "decode": 8.0}
"""Issue targets, as multiples of one clone of a 16M-element fp32 chunk."""

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """``"1M,64K,1000"`` -> element counts (binary suffixes K, M, G)."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", item, flags=re.IGNORECASE)
        if not match or int(match.group(1)) == 0:
            raise argparse.ArgumentTypeError(f"bad size {item!r}: use a positive integer with an optional K/M/G suffix")
        sizes.append(int(match.group(1)) * _SUFFIXES[match.group(2).upper()])
    return sizes


def parse_loads(text: str) -> list[float]:
    """``"0.5,0.7"`` -> loads in (0, 1]."""
    try:
        loads = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad loads {text!r}: use comma-separated numbers") from None
    if not all(0 < x <= 1 for x in loads):
        raise argparse.ArgumentTypeError(f"loads must be in (0, 1], got {text!r}")
    return loads


def human(n: int) -> str:
    """``16777216`` -> ``"16M"``."""
    for suffix in ("G", "M", "K"):
        if n % _SUFFIXES[suffix] == 0:
            return f"{n // _SUFFIXES[suffix]}{suffix}"
    return str(n)


def median_time(fn: Callable[[], Any], repeats: int, setup: Optional[Callable[[], Any]] = None) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs, after one untimed warm-up."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i:
            times.append(elapsed)
    return statistics.median(times)


def nonzero_normal(k: int) -> torch.Tensor:
    """``k`` standard normal fp32 values, none exactly zero."""
    values = torch.randn(k)
    return values.masked_fill_(values == 0, 1.0)


def random_sparse(numel: int, density: float) -> torch.Tensor:
    """A dense fp32 vector with a uniformly random support of about ``density * numel``."""
    mask = torch.rand(numel) < density
    values = torch.zeros(numel)
    values[mask] = nonzero_normal(int(mask.sum()))
    return values


def union_table(numel: int, layout: SketchLayout, density: float, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed table and merged index of two ranks' random supports of ``density`` each."""
    a, b = random_sparse(numel, density), random_sparse(numel, density)
    table = encode(a, layout) + encode(b, layout)
    return table, merge_index(build_index(a, bits), build_index(b, bits), bits)


def throughput(sizes: list[int], ratio: float, density: float, bits: int, repeats: int) -> list[dict[str, Any]]:
    """Time every codec op at every size; one row per (size, op)."""
    from tagc.kernels import cpu

    ops = ("clone", "copy_", "sparsify", "build_index", "encode", "compress_", "decode")
    if cpu.numba_available():
        ops += ("compress_ numba", "decode numba")
    rows = []
    bar = tqdm(total=len(sizes) * len(ops), desc="throughput", file=sys.stderr)
    for numel in sizes:
        layout = SketchLayout(numel, ratio)
        x = torch.randn(numel)
        times: dict[str, float] = {}
        bar.set_postfix(size=human(numel))

        # Each timed lambda binds its tensors as defaults: it runs at once, in this iteration, and the
        # ``del``s below free the large buffers before the next phase allocates its own.
        out = torch.empty_like(x)
        times["clone"] = median_time(x.clone, repeats)
        times["copy_"] = median_time(lambda out=out, x=x: out.copy_(x), repeats)
        del out
        bar.update(2)

        times["sparsify"] = median_time(lambda x=x: split_kept(x, density), repeats)
        kept, _ = split_kept(x, density)
        bar.update()
        times["build_index"] = median_time(lambda kept=kept: build_index(kept, bits), repeats)
        bar.update()
        times["encode"] = median_time(lambda kept=kept, layout=layout: encode(kept, layout), repeats)
        del kept
        bar.update()

        residual = torch.zeros_like(x)
        times["compress_"] = median_time(
            lambda x=x, residual=residual, layout=layout: compress_(x, residual, density, layout, bits),
            repeats,
            setup=residual.zero_,
        )
        if "compress_ numba" in ops:
            times["compress_ numba"] = median_time(
                lambda x=x, residual=residual, layout=layout: cpu.compress_cpu(x, residual, density, layout, bits),
                repeats,
                setup=residual.zero_,
            )
        del residual
        bar.update()

        planned = plan_density(ratio, 2)
        table, index = union_table(numel, layout, planned, bits)
        _, stats = decode(table, index, layout, bits)
        times["decode"] = median_time(
            lambda table=table, index=index, layout=layout: decode(table, index, layout, bits), repeats
        )
        if "decode numba" in ops:
            times["decode numba"] = median_time(
                lambda table=table, index=index, layout=layout: cpu.decode_cpu(table, index, layout, bits), repeats
            )
        bar.update()

        for op in ops:
            row = {
                "numel": numel,
                "op": op,
                "seconds": times[op],
                "gb_per_s": numel * 4 / times[op] / 1e9,
                "x_clone": times[op] / times["clone"],
                "x_copy": times[op] / times["copy_"],
            }
            if op.startswith("decode"):
                row.update(load=stats.support / layout.table_numel, unpeeled=stats.unpeeled, density=planned)
            elif op.startswith(("sparsify", "compress_")):
                row.update(density=density)
            if op.endswith("numba"):
                row.update(x_reference=times[op] / times[op.split()[0]])
            rows.append(row)
    bar.close()
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's targets, checked at 16M elements (or the largest size measured)."""
    measured = sorted({r["numel"] for r in rows})
    numel = TARGET_NUMEL if TARGET_NUMEL in measured else measured[-1]
    result = {}
    for op, limit in TARGETS.items():
        row = next(r for r in rows if r["numel"] == numel and r["op"] == ("compress_" if op == "compress" else op))
        result[op] = {
            "numel": numel,
            "x_clone": row["x_clone"],
            "x_copy": row["x_copy"],
            "limit_x_clone": limit,
            "pass": row["x_clone"] <= limit,
        }
    return result


def peeling(
    sizes: list[int], ratio: float, loads: list[float], trials: int, bits: int
) -> list[dict[str, Any]]:
    """Decode fresh random supports at each load; one row per (size, load).

    A uniformly random support stands for the union of independent per-rank supports.
    ``success`` counts trials with nothing left unrecovered after peeling and the exact
    solve; ``peel_only`` those that needed no solve; ``recovered`` is the mean fraction
    of the support recovered exactly.
    """
    rows = []
    bar = tqdm(total=len(sizes) * len(loads) * trials, desc="peeling", file=sys.stderr)
    for numel in sizes:
        layout = SketchLayout(numel, ratio)
        for load in loads:
            k = min(numel, round(load * layout.table_numel))
            bar.set_postfix(size=human(numel), load=load)
            success = peel_only = 0
            recovered, solved, seconds = [], [], []
            for _ in range(trials):
                values = torch.zeros(numel)
                values[torch.randperm(numel)[:k]] = nonzero_normal(k)
                table, index = encode(values, layout), build_index(values, bits)
                start = time.perf_counter()
                _, stats = decode(table, index, layout, bits)
                seconds.append(time.perf_counter() - start)
                success += stats.unpeeled == 0
                peel_only += stats.unpeeled == 0 and stats.solved == 0
                recovered.append(stats.peeled / stats.support)
                solved.append(stats.solved / stats.support)
                bar.update()
            rows.append(
                {
                    "numel": numel,
                    "lanes": layout.lanes,
                    "rows_per_lane": layout.rows,
                    "load": k / layout.table_numel,
                    "trials": trials,
                    "success": success / trials,
                    "peel_only": peel_only / trials,
                    "recovered": statistics.fmean(recovered),
                    "solved": statistics.fmean(solved),
                    "seconds": statistics.fmean(seconds),
                }
            )
    bar.close()
    return rows


def measured_thresholds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size: the highest load up to which every trial succeeded, and the first load
    where fewer than half did (``None`` where the sweep does not reach it)."""
    result = []
    for numel in dict.fromkeys(r["numel"] for r in rows):
        curve = sorted((r for r in rows if r["numel"] == numel), key=lambda r: r["load"])
        all_ok = None
        for r in curve:
            if r["success"] < 1.0:
                break
            all_ok = r["load"]
        below_half = next((r["load"] for r in curve if r["success"] < 0.5), None)
        result.append({"numel": numel, "all_success_up_to": all_ok, "below_half_at": below_half})
    return result


def plot_peeling(rows: list[dict[str, Any]], path: str, ratio: float) -> None:
    """Success rate and recovered fraction vs load, one line per size, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)
    for i, numel in enumerate(dict.fromkeys(r["numel"] for r in rows)):
        curve = sorted((r for r in rows if r["numel"] == numel), key=lambda r: r["load"])
        loads = [r["load"] for r in curve]
        color = f"C{i}"
        lanes = curve[0]["lanes"]
        label = f"{human(numel)} elements ({lanes} lane{'s' if lanes > 1 else ''} x {curve[0]['rows_per_lane']} rows)"
        left.plot(loads, [r["success"] for r in curve], "o-", color=color, label=f"{label}: peel + exact solve")
        left.plot(loads, [r["peel_only"] for r in curve], "s:", color=color, alpha=0.7, label=f"{label}: peeling alone")
        right.plot(loads, [r["recovered"] for r in curve], "o-", color=color, label=label)
    for ax in (left, right):
        ax.axvline(PEELING_THRESHOLD, color="k", ls="--", lw=1, label=f"threshold {PEELING_THRESHOLD:g}")
        ax.axvline(PLANNED_LOAD, color="g", ls="-.", lw=1, label=f"planned load {PLANNED_LOAD:g}")
        ax.set_xlabel("load (union non-zeros per row of a lane)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    trials = rows[0]["trials"]
    left.set_ylabel(f"fraction of {trials} trials recovered exactly")
    left.set_title("Whole support recovered")
    right.set_ylabel("mean fraction of the support recovered exactly")
    right.set_title("Positions recovered")
    left.legend(fontsize=7, loc="lower left")
    right.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"TAGC count-sketch peeling, ratio {ratio:g}, 3 hashes")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_throughput(rows: list[dict[str, Any]], density: float) -> None:
    print(f"\nThroughput on this CPU, {torch.get_num_threads()} torch thread(s), GB/s of fp32 input, median:")
    print(f"{'size':>6} {'op':<15} {'ms':>10} {'GB/s':>8} {'x clone':>9} {'x copy_':>9}")
    for r in rows:
        note = ""
        if r["op"].startswith("decode"):
            note = f"  union load {r['load']:.3f} (2 ranks at {r['density']:.4f}), unpeeled {r['unpeeled']}"
        elif r["op"].startswith(("sparsify", "compress_")):
            note = f"  density {density:g}"
        if "x_reference" in r:
            note += f"  ({1 / r['x_reference']:.1f}x faster than the reference)"
        print(
            f"{human(r['numel']):>6} {r['op']:<15} {r['seconds'] * 1e3:>10.2f} {r['gb_per_s']:>8.3f} "
            f"{r['x_clone']:>9.2f} {r['x_copy']:>9.2f}{note}"
        )
    print("clone allocates fresh memory (page faults included); copy_ writes into a warm preallocated buffer.")


def print_targets(result: dict[str, dict[str, Any]], density: float) -> None:
    what = {
        "compress": f"fused sparsify+index+encode (compress_) at {density:g} density",
        "decode": "decode at the planned density",
    }
    for op, t in result.items():
        verdict = "PASS" if t["pass"] else "FAIL"
        print(
            f"{verdict}: {what[op]}, {human(t['numel'])} fp32: {t['x_clone']:.2f}x clone "
            f"(target <= {t['limit_x_clone']:g}x; {t['x_copy']:.2f}x copy_)"
        )


def print_peeling(rows: list[dict[str, Any]], thresholds: list[dict[str, Any]]) -> None:
    print(f"\nPeeling vs load (theoretical threshold {PEELING_THRESHOLD}, planned load {PLANNED_LOAD}):")
    print(
        f"{'size':>6} {'lanes':>5} {'rows':>6} {'load':>6} {'success':>8} "
        f"{'peel-only':>9} {'recovered':>10} {'solved':>8} {'s/decode':>9}"
    )
    for r in rows:
        print(
            f"{human(r['numel']):>6} {r['lanes']:>5} {r['rows_per_lane']:>6} {r['load']:>6.3f} {r['success']:>8.2f} "
            f"{r['peel_only']:>9.2f} {r['recovered']:>10.4f} {r['solved']:>8.4f} {r['seconds']:>9.3f}"
        )
    for t in thresholds:
        up_to = "none" if t["all_success_up_to"] is None else f"{t['all_success_up_to']:.3f}"
        below = "not reached" if t["below_half_at"] is None else f"{t['below_half_at']:.3f}"
        print(
            f"measured threshold, {human(t['numel'])}: every trial recovered up to load {up_to}; "
            f"below 50% success from load {below}"
        )


def main(argv: Optional[list[str]] = None) -> None:
    """Run the codec benchmark (see ``--help``)."""
    parser = argparse.ArgumentParser(prog="python -m tagc.bench codec", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=parse_sizes, default=None, help=f"throughput sizes in elements (default {DEFAULT_SIZES})"
    )
    parser.add_argument("--ratio", type=float, default=10.0, help="sketch compression ratio (default 10)")
    parser.add_argument(
        "--density", type=float, default=0.04, help="kept fraction for sparsify/compress_ (default 0.04)"
    )
    parser.add_argument("--bits", type=int, choices=(1, 4), default=1, help="index bits per element (default 1)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per op, median reported (default 5; quick 2)"
    )
    parser.add_argument(
        "--trials", type=int, default=None, help="random supports per load on the peeling curve (default 20; quick 2)"
    )
    parser.add_argument(
        "--peel-sizes",
        type=parse_sizes,
        default=None,
        help=f"chunk sizes for the peeling curve (default {DEFAULT_PEEL_SIZES})",
    )
    parser.add_argument("--loads", type=parse_loads, default=None, help="comma-separated loads for the peeling curve")
    parser.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default="bench_out/peeling.png",
        help="peeling curve PNG (default bench_out/peeling.png)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few trials (smoke test)")
    parser.add_argument("--seed", type=int, default=0, help="torch RNG seed (default 0)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads for this run (default: torch's setting)"
    )
    args = parser.parse_args(argv)
    if any(v is not None and v < 1 for v in (args.repeats, args.trials, args.threads)):
        parser.error("--repeats, --trials and --threads must be at least 1")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> None:
    """The benchmark proper, on parsed arguments."""
    sizes = args.sizes or parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    peel_sizes = args.peel_sizes or parse_sizes(QUICK_PEEL_SIZES if args.quick else DEFAULT_PEEL_SIZES)
    loads = args.loads or list(QUICK_LOADS if args.quick else DEFAULT_LOADS)
    repeats = args.repeats or (2 if args.quick else 5)
    trials = args.trials or (2 if args.quick else 20)
    torch.manual_seed(args.seed)

    rows = throughput(sizes, args.ratio, args.density, args.bits, repeats)
    print_throughput(rows, args.density)
    target_result = targets(rows)
    print_targets(target_result, args.density)

    peel_rows = peeling(peel_sizes, args.ratio, loads, trials, args.bits)
    thresholds = measured_thresholds(peel_rows)
    print_peeling(peel_rows, thresholds)
    plot_peeling(peel_rows, args.plot, args.ratio)
    print(f"peeling curve: {args.plot}")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {
                        "ratio": args.ratio,
                        "density": args.density,
                        "bits": args.bits,
                        "repeats": repeats,
                        "trials": trials,
                        "threads": torch.get_num_threads(),
                    },
                    "throughput": rows,
                    "targets": target_result,
                    "peeling": peel_rows,
                    "peeling_thresholds": thresholds,
                },
                f,
                indent=1,
            )
        print(f"results: {args.json}")
