"""Codec benchmark: the peeling success curve of TAGC's count sketch.

``python -m tagc.bench codec [--json out.json] [--quick]``

It decodes random supports at a sweep of loads (union non-zeros per row of a lane) and counts how often, and how
much of, the support is recovered exactly: the margin ``PLANNED_LOAD`` keeps below the threshold (docs/design.md,
section 9), printed as a table per size. Its CPU throughput part (``clone`` multiples, the issue's targets) and its
plot were removed (docs/results.md, "Removed from the bench").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Optional

import torch
from tqdm import tqdm

from tagc.sketch import PEELING_THRESHOLD, PLANNED_LOAD, SketchLayout, build_index, decode, encode

DEFAULT_PEEL_SIZES = "1M,16K"
QUICK_PEEL_SIZES = "4K"
DEFAULT_LOADS = (0.5, 0.6, 0.65, 0.7, 0.74, 0.76, 0.77, 0.78, 0.79, 0.8, 0.81, 0.82, 0.84, 0.87, 0.9, 0.95)
QUICK_LOADS = (0.5, 0.7, 0.9)

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


def human(n: int) -> str:
    """``16777216`` -> ``"16M"``."""
    for suffix in ("G", "M", "K"):
        if n % _SUFFIXES[suffix] == 0:
            return f"{n // _SUFFIXES[suffix]}{suffix}"
    return str(n)


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
                normal = torch.randn(k)
                values[torch.randperm(numel)[:k]] = normal.masked_fill_(normal == 0, 1.0)  # no value exactly 0
                table, index = encode(values, layout), build_index(values, bits)
                start = time.perf_counter()
                _, stats = decode(table, index, layout, bits)
                seconds.append(time.perf_counter() - start)
                success += stats.unpeeled == 0
                peel_only += stats.unpeeled == 0 and stats.solved == 0
                recovered.append(stats.peeled / stats.support)
                solved.append(stats.solved / stats.support)
                bar.update()
            rows.append({"numel": numel, "lanes": layout.lanes, "rows_per_lane": layout.rows,
                         "load": k / layout.table_numel, "trials": trials, "success": success / trials,
                         "peel_only": peel_only / trials, "recovered": statistics.fmean(recovered),
                         "solved": statistics.fmean(solved), "seconds": statistics.fmean(seconds)})
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


def print_peeling(rows: list[dict[str, Any]], thresholds: list[dict[str, Any]]) -> None:
    print(f"\nPeeling vs load (theoretical threshold {PEELING_THRESHOLD}, planned load {PLANNED_LOAD}):")
    print(f"{'size':>6} {'lanes':>5} {'rows':>6} {'load':>6} {'success':>8} {'peel-only':>9} {'recovered':>10} "
          f"{'solved':>8} {'s/decode':>9}")
    for r in rows:
        print(f"{human(r['numel']):>6} {r['lanes']:>5} {r['rows_per_lane']:>6} {r['load']:>6.3f} {r['success']:>8.2f} "
              f"{r['peel_only']:>9.2f} {r['recovered']:>10.4f} {r['solved']:>8.4f} {r['seconds']:>9.3f}")
    for t in thresholds:
        up_to = "none" if t["all_success_up_to"] is None else f"{t['all_success_up_to']:.3f}"
        below = "not reached" if t["below_half_at"] is None else f"{t['below_half_at']:.3f}"
        print(f"measured threshold, {human(t['numel'])}: every trial recovered up to load {up_to}; "
              f"below 50% success from load {below}")


def main(argv: Optional[list[str]] = None) -> None:
    """Run the codec benchmark (see ``--help``)."""
    parser = argparse.ArgumentParser(prog="python -m tagc.bench codec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratio", type=float, default=10.0, help="sketch compression ratio (default 10)")
    parser.add_argument("--bits", type=int, choices=(1, 4), default=1, help="index bits per element (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    parser.add_argument("--quick", action="store_true", help=f"size {QUICK_PEEL_SIZES} (default {DEFAULT_PEEL_SIZES}), "
                        "3 loads, 2 trials per load (default 20): a smoke test")
    parser.add_argument("--seed", type=int, default=0, help="torch RNG seed (default 0)")
    args = parser.parse_args(argv)
    peel_sizes = parse_sizes(QUICK_PEEL_SIZES if args.quick else DEFAULT_PEEL_SIZES)
    loads = list(QUICK_LOADS if args.quick else DEFAULT_LOADS)
    trials = 2 if args.quick else 20
    torch.manual_seed(args.seed)

    peel_rows = peeling(peel_sizes, args.ratio, loads, trials, args.bits)
    thresholds = measured_thresholds(peel_rows)
    print_peeling(peel_rows, thresholds)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": {"ratio": args.ratio, "bits": args.bits, "trials": trials}, "peeling": peel_rows,
                       "peeling_thresholds": thresholds}, f, indent=1)
        print(f"results: {args.json}")
