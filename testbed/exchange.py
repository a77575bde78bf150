"""Gradient exchange over an emulated link: plain reduce-scatter against TAGC (docs/design.md §10).

``python -m testbed.exchange --link 10gbit,1gbit,100mbit [--world 2] [--sizes mlp,lmhead]
[--json PATH] [--quick]``

For each link rate the ranks run in their own network namespace whose loopback is shaped
with tbf (:mod:`testbed.link`; ``--link none`` is the plain loopback). On GPT-2-shaped gradient
buckets each rank times, median over ``--reps`` rounds after ``--warmup`` (methods
interleaved round by round so machine-load drift hits them alike):

* ``gloo rs fp32``: gloo's own ``reduce_scatter_single``/``reduce_scatter_tensor``,
* ``fair fp32`` / ``fair bf16``: :func:`tagc.hooks.transport.plain_reduce_scatter` (all-to-all
  in <= 1 MB pieces + local sum; the (N-1)/N volume of a ring reduce-scatter),
* ``tagc rR iB pipe|serial``: :meth:`TAGCHook.reduce_scatter` at ratio R, B-bit index, with
  pipelining (default ``min_part``) or without (one part); ``... lean``: the lean wire
  (``--wire lean``: Elias-Fano coded positions and bf16 sketch cells);
* ``codec NAME`` (``--codecs``): a peer codec on the same engine; ``codec topk lean``: ``topk``
  with the same lean wire (coded positions, bf16 values).

``bits_per_param`` is the wire bits a rank sends per gradient element (of the whole bucket), the
figure the lean wire is judged by (fp32 plain: ``32 (N-1)/N``).

A time is the slowest rank's. ``ms_per_mb`` is per MB (10^6 bytes) of the fp32 gradient a
rank holds (the whole bucket). Wire bytes per rank are counted (TAGC: the hook's stats;
fair: bytes handed to the all-to-all; gloo: the all-reduce ring volume, which is what it
sends) and, inside a namespace, also read from the loopback's own byte counter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Optional

from testbed.launch import Launch, torchrun_argv
from testbed.link import LinkError, ShapedLink, format_rate, parse_rate
from testbed.paper import EXCHANGE_MS_PER_MB as PAPER

MB = 1e6
TARGET_RATIO = 0.25
GPT2_SMALL = {"n_embd": 768, "vocab": 50257}
SIZES = {
    # one GPT-2-small MLP block: c_fc (768x3072) and c_proj (3072x768) weights, ~4.7M params
    "mlp": [("h.0.mlp.c_fc.weight", 768 * 3072), ("h.0.mlp.c_proj.weight", 3072 * 768)],
    # the tied token embedding / LM head, 50257x768, ~38.6M params
    "lmhead": [("lm_head.weight", 50257 * 768)],
}
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20}
REQUIRED_KEYS = ("method", "link", "ms_per_mb", "wire_bytes_per_rank", "bits_per_param", "ratio_to_fair_baseline")
WIRES = ("bitmap", "lean")
LEAN_OPTIONS = {"positions": "coded", "value_dtype": "bfloat16"}
"""The lean wire of the sparse codecs (``tagc``, ``topk``): Elias-Fano positions, bf16 values."""
BITMAP_OPTIONS = {"positions": "bitmap", "value_dtype": "float32"}
"""The TAGC paper's wire, which ``tagc.hook()`` does not default to: full support bitmaps, float32 cells."""


# ---------------------------------------------------------------------------- buckets


def bucket(size: str, world: int) -> tuple[list[tuple[str, int, int]], int]:
    """``(segments, chunk)`` for a named bucket (``mlp``, ``lmhead``) or an element count (``1M``).

    Like FSDP2, a rank's chunk is the concatenation of every parameter's padded shard
    (``ceil(numel / world)`` elements each); segments are ``(name, start, numel)``.
    """
    if size in SIZES:
        params = SIZES[size]
    else:
        text = size.strip().upper()
        suffix = text[-1] if text and text[-1] in _SUFFIXES and not text[-1].isdigit() else ""
        try:
            numel = int(text[: len(text) - len(suffix)]) * _SUFFIXES[suffix]
        except ValueError:
            raise ValueError(f"bad size {size!r}: use {', '.join(SIZES)} or an element count like 256K, 1M") from None
        if numel <= 0:
            raise ValueError(f"bad size {size!r}: must be positive")
        params = [("w.weight", numel)]
    segments, start = [], 0
    for name, numel in params:
        shard = -(-numel // world)
        segments.append((name, start, shard))
        start += shard
    return segments, start


# ---------------------------------------------------------------------------- worker (one rank)


def _lo_tx_bytes() -> Optional[int]:
    """Bytes sent by ``lo`` in this process's network namespace (``/proc/net/dev``)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                if line.strip().startswith("lo:"):
                    return int(line.split(":", 1)[1].split()[8])
    except OSError:
        return None
    return None


def _methods(args, world: int, chunk: int, grad, segments) -> list[dict]:
    import torch
    import torch.distributed as dist

    import tagc
    from tagc.hooks import Segment
    from tagc.hooks.engine import MIN_PART
    from tagc.hooks.transport import plain_reduce_scatter

    n = chunk * world
    rows = grad.view(world, chunk)
    rows_bf16 = rows.bfloat16()
    out = torch.empty(chunk)
    methods: list[dict] = []
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rs_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

    def gloo_rs() -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            rs(out, grad)
        return 2 * (world - 1) * chunk * 4  # gloo reduce-scatters via an all-reduce: ring volume

    methods.append(dict(method="gloo rs fp32", kind="gloo", dtype="fp32", run=gloo_rs,
                        wire_source=f"formula: gloo {rs_name} = all-reduce ring, 2(N-1)/N*n*4"))
    methods.append(dict(method="fair fp32", kind="fair", dtype="fp32", run=lambda: plain_reduce_scatter(rows, None)[1],
                        wire_source="counted: all-to-all bytes sent"))
    methods.append(
        dict(
            method="fair bf16",
            kind="fair",
            dtype="bf16",
            run=lambda: plain_reduce_scatter(rows_bf16, None)[1],
            wire_source="counted: all-to-all bytes sent",
        )
    )
    segs = [Segment(name, start, numel) for name, start, numel in segments]
    for ratio, bits, overlap, wire in (
        (r, b, o, w) for r in args.ratios for b in args.bits for o in args.overlap for w in args.wire
    ):
        if wire == "lean" and bits != 1:
            continue  # coded positions code a set: 1-bit index only
        lean = wire == "lean"
        hook = tagc.hook(
            plain="fp32",
            feedback="classic",
            dense_steps=0,
            ratio=ratio,
            index_bits=bits,
            select="all",
            min_part=MIN_PART if overlap else max(chunk, 1),
            **(LEAN_OPTIONS if lean else BITMAP_OPTIONS),
        )
        inp = torch.empty_like(grad)

        def prepare(inp=inp) -> None:
            inp.copy_(grad)  # the hook may use its input as scratch; not timed

        def run(hook=hook, inp=inp) -> int:
            before = hook.total.wire_bytes
            hook.reduce_scatter(out, inp, None, dist.ReduceOp.SUM, segs)
            return hook.total.wire_bytes - before

        methods.append(dict(
            method=f"tagc r{ratio:g} i{bits} {'pipe' if overlap else 'serial'}{' lean' if lean else ''}", kind="tagc",
            dtype="fp32", ratio=ratio, index_bits=bits, overlap=overlap, wire=wire, hook=hook, prepare=prepare, run=run,
            n_parts=len(hook._plan(tuple(segs), chunk, world).compressed_parts),
            formula_wire_bytes=((world - 1) / world * n * (bits + 32 / ratio) / 8 if not lean else
                                (world - 1) * hook.wire_row_bytes(segs, chunk, world, torch.float32)),
            wire_source="counted: hook.stats wire_bytes",
        ))
    peers = [(name, {}) for name in args.codecs]
    if "topk" in args.codecs and "lean" in args.wire:
        peers.append(("topk", LEAN_OPTIONS))
    for name, options in peers:  # the peer codecs on the same engine, every column selected
        shaped = [Segment(seg.name, seg.start, seg.numel, shape=_matrix_shape(seg.numel * world)) for seg in segs]
        codec_hook = tagc.hook(codec=name, select="all", dense_steps=0, **options)
        codec_inp = torch.empty_like(grad)

        def prepare_codec(inp=codec_inp) -> None:
            inp.copy_(grad)

        def run_codec(hook=codec_hook, inp=codec_inp, shaped=shaped) -> int:
            before = hook.total.wire_bytes
            hook.reduce_scatter(out, inp, None, dist.ReduceOp.SUM, shaped)
            return hook.total.wire_bytes - before

        single_round = codec_hook.codec.rounds == 1
        methods.append(
            dict(
                method=f"codec {name}{' lean' if options else ''}",
                kind="codec",
                dtype="fp32",
                hook=codec_hook,
                prepare=prepare_codec,
                run=run_codec,
                formula_wire_bytes=(world - 1) * codec_hook.wire_row_bytes(shaped, chunk, world, torch.float32)
                if single_round
                else None,
                wire_source="counted: hook.stats wire_bytes",
            )
        )
    return methods


def _matrix_shape(numel: int) -> tuple[int, ...]:
    """A 2-D shape for a synthetic parameter (rows x 64 where it divides), for codecs that need matrices."""
    return (numel // 64, 64) if numel % 64 == 0 and numel >= 64 * 64 else (numel,)


def _worker(args) -> None:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # torchrun's env://
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    in_namespace = args.count_lo
    rows_out: list[dict] = []
    try:
        for size in args.sizes:
            segments, chunk = bucket(size, world)
            n = chunk * world
            gen = torch.Generator().manual_seed(1000 + rank)
            grad = torch.randn(n, generator=gen)
            methods = _methods(args, world, chunk, grad, segments)
            for m in methods:
                m.update(times=[], wire=[], lo=[], deltas=[])
            rounds = args.warmup + args.reps
            bar = tqdm(total=rounds * len(methods), desc=f"{args.link_name} {size}", file=sys.stderr,
                       disable=rank != 0 or args.no_progress, leave=False)
            for r in range(rounds):
                timed = r >= args.warmup
                for m in methods:
                    before = dict(vars(m["hook"].total)) if m["kind"] == "tagc" else None
                    if "prepare" in m:
                        m["prepare"]()
                    dist.barrier()
                    lo0 = _lo_tx_bytes() if in_namespace else None
                    start = time.perf_counter()
                    sent = m["run"]()
                    elapsed = time.perf_counter() - start
                    slowest = torch.tensor([elapsed], dtype=torch.float64)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    if timed:
                        m["times"].append(float(slowest))
                        m["wire"].append(int(sent))
                        if before is not None:
                            after = vars(m["hook"].total)
                            m["deltas"].append({k: after[k] - before[k] for k in before})
                        if lo0 is not None:
                            m["lo"].append(_lo_tx_bytes() - lo0)
                    bar.update(1)
            bar.close()
            for m in methods:
                rows_out.append(_summarise(m, size, n, chunk, world, args))
            del methods
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows_out, f)


def _summarise(m: dict, size: str, n: int, chunk: int, world: int, args) -> dict:
    import torch
    import torch.distributed as dist

    median = statistics.median(m["times"])
    row: dict[str, Any] = dict(
        method=m["method"], kind=m["kind"], dtype=m["dtype"], size=size, numel=n, chunk=chunk, world=world,
        reps=len(m["times"]), times_s=m["times"], median_s=median, ms_per_mb=median * 1e3 / (n * 4 / MB),
        wire_bytes_per_rank=statistics.median(m["wire"]), wire_bytes_source=m["wire_source"],
        lo_bytes_per_rank=(statistics.median(m["lo"]) / world) if m["lo"] else None,
        plain_fp32_bytes_per_rank=(world - 1) * chunk * 4,
        bits_per_param=8 * statistics.median(m["wire"]) / n,
    )
    if m["kind"] == "codec":
        row["formula_wire_bytes"] = m["formula_wire_bytes"]
    if m["kind"] == "tagc":
        deltas = m["deltas"]
        steps = len(deltas)
        # per-rep times, median (robust to load spikes on a shared machine), then the slowest rank
        per_step = {k: statistics.median(d[k] for d in deltas) for k in ("compress_s", "decode_s", "exposed_s")}
        worst = torch.tensor([per_step["compress_s"], per_step["decode_s"], per_step["exposed_s"]], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        counts = torch.tensor(
            [sum(d[k] for d in deltas) for k in ("support", "peeled", "unpeeled", "estimated")], dtype=torch.float64
        )
        dist.all_reduce(counts)
        support, peeled, unpeeled, estimated = (float(c) for c in counts)
        row.update(
            ratio=m["ratio"], index_bits=m["index_bits"], overlap=m["overlap"], wire=m["wire"], n_parts=m["n_parts"],
            compress_s=float(worst[0]), decode_s=float(worst[1]), exposed_s=float(worst[2]),
            compute_s=float(worst[0] + worst[1]), formula_wire_bytes=m["formula_wire_bytes"],
            peel_success=peeled / support if support else 1.0, unpeeled=unpeeled, estimated=estimated,
            support_fraction=support / (steps * n) if steps else 0.0,
        )
    return row


# ---------------------------------------------------------------------------- parent: links, tables


def _worker_args(args, out: str, link_name: str, count_lo: bool) -> list[str]:
    argv = [
        "--worker",
        "--out",
        out,
        "--link-name",
        link_name,
        "--world",
        str(args.world),
        "--sizes",
        ",".join(args.sizes),
        "--ratios",
        ",".join(f"{r:g}" for r in args.ratios),
        "--bits",
        ",".join(map(str, args.bits)),
        "--overlap",
        ",".join("on" if o else "off" for o in args.overlap),
        "--reps",
        str(args.reps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--pg-timeout",
        str(args.pg_timeout),
        "--wire",
        ",".join(args.wire),
    ]
    if args.codecs:
        argv += ["--codecs", ",".join(args.codecs)]
    if count_lo:
        argv.append("--count-lo")
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def run_link(args, link_text: str) -> list[dict]:
    """Run every rank for one link setting and return rank 0's rows, annotated with the link."""
    rate = parse_rate(link_text)
    name = format_rate(rate)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a namespace has no hostname lookup: c10d warns per socket
    with tempfile.TemporaryDirectory(prefix="tagc-exchange-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        if rate is None:
            launch = Launch(
                [torchrun_argv("testbed.exchange", _worker_args(args, out, name, False), args.world)], env=env
            )
            launch.wait(deadline_s=args.timeout, grace_s=args.pg_timeout, what="exchange benchmark ranks")
            description = "unshaped loopback (this machine's network namespace)"
        else:
            with ShapedLink(rate, world=args.world) as link:
                description = link.describe()
                print(f"[exchange] {description}", file=sys.stderr, flush=True)
                launch = Launch(
                    [torchrun_argv("testbed.exchange", _worker_args(args, out, name, True), args.world)],
                    env=env,
                    wrap=lambda host, argv: link.wrap(argv),
                )
                launch.wait(deadline_s=args.timeout, grace_s=args.pg_timeout, what="exchange benchmark ranks")
        with open(out) as f:
            rows = json.load(f)
    for row in rows:
        row.update(link=name, link_bps=rate, link_description=description)
    annotate(rows)
    return rows


def annotate(rows: list[dict]) -> None:
    """Add ``ratio_to_fair_baseline``, the crossover estimate and the compute-bound flag."""
    fair = {(r["link"], r["size"]): r for r in rows if r["method"] == "fair fp32"}
    for row in rows:
        base = fair.get((row["link"], row["size"]))
        row["ratio_to_fair_baseline"] = row["ms_per_mb"] / base["ms_per_mb"] if base else None
        if row["kind"] != "tagc" or base is None:
            continue
        saved = base["wire_bytes_per_rank"] - row["wire_bytes_per_rank"]
        # TAGC ~ compute + tagc_bytes/rate, plain ~ plain_bytes/rate  =>  TAGC wins below 8*saved/compute bit/s
        row["crossover_bps"] = 8 * saved / row["compute_s"] if saved > 0 and row["compute_s"] > 0 else None
        rate = row.get("link_bps")
        if rate:
            wire_s = 8 * row["wire_bytes_per_rank"] / rate
            row["model_s"] = row["compute_s"] + wire_s
            row["model_plain_s"] = 8 * base["wire_bytes_per_rank"] / rate
            row["compute_bound"] = row["compute_s"] > wire_s
        else:
            row["compute_bound"] = None


def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "-"
    return f"{b / MB:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def table(rows: list[dict]) -> str:
    """A text table of one link's rows (all sizes)."""
    lines = []
    header = (
        f"{'method':<26} {'ms/MB':>8} {'x fair':>7} {'wire/rank':>10} {'bits/param':>10} {'lo/rank':>10} {'peel':>7} "
        f"{'compress':>9} {'decode':>8} {'crossover':>10}  note"
    )
    for size in dict.fromkeys(r["size"] for r in rows):
        sub = [r for r in rows if r["size"] == size]
        first = sub[0]
        lines.append(f"-- link {first['link']} | bucket {size}: {first['numel'] / 1e6:.2f}M params "
                     f"({first['numel'] * 4 / MB:.1f} MB fp32), world {first['world']}, median of {first['reps']} --")
        lines.append(header)
        for r in sub:
            tagc = r["kind"] == "tagc"
            note = ""
            if tagc:
                note = f"{r['n_parts']} part{'s' if r['n_parts'] > 1 else ''}"
                if r.get("compute_bound") is not None:
                    note += ", compute-bound" if r["compute_bound"] else ", link-bound"
            if r["kind"] == "gloo":
                note = "gloo all-reduce underneath"
            x = r["ratio_to_fair_baseline"]
            lines.append(
                f"{r['method']:<26} {r['ms_per_mb']:>8.3f} {x:>6.2f}x {_fmt_bytes(r['wire_bytes_per_rank']):>10} "
                f"{r['bits_per_param']:>10.3f} "
                f"{_fmt_bytes(r['lo_bytes_per_rank']):>10} "
                f"{(format(r['peel_success'], '.4f') if tagc else '-'):>7} "
                f"{(format(r['compress_s'] * 1e3, '.0f') + ' ms' if tagc else '-'):>9} "
                f"{(format(r['decode_s'] * 1e3, '.0f') + ' ms' if tagc else '-'):>8} "
                f"{(format_rate(int(r['crossover_bps'])) if tagc and r.get('crossover_bps') else '-'):>10}  {note}"
            )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Paper reference, target, the best TAGC variant per link and the crossover estimate."""
    lines = [
        f"paper (GPT-2 ~162M, 2 nodes, 10 Gbit, GPUs): "
        f"FSDP {PAPER['fsdp_ms_per_mb']} -> TAGC {PAPER['tagc_ms_per_mb']} ms/MB "
        f"= {PAPER['ratio']}x; target: <= {TARGET_RATIO}x of the fair fp32 baseline "
        "where compression is not the bottleneck",
    ]
    for (link, size) in dict.fromkeys((r["link"], r["size"]) for r in rows):
        sub = [r for r in rows if r["link"] == link and r["size"] == size and r["kind"] == "tagc"]
        if not sub:
            continue
        best = min(sub, key=lambda r: r["ms_per_mb"])
        cross = max(sub, key=lambda r: r.get("crossover_bps") or 0)
        bf16 = next((r for r in rows if r["link"] == link and r["size"] == size and r["method"] == "fair bf16"), None)
        verdict = "meets" if best["ratio_to_fair_baseline"] <= TARGET_RATIO else "misses"
        lines.append(
            f"{link:>7} {size}: best {best['method']} {best['ms_per_mb']:.3f} ms/MB "
            f"= {best['ratio_to_fair_baseline']:.2f}x fair fp32"
            + f" at {best['bits_per_param']:.2f} bits/param"
            + (f" ({best['ms_per_mb'] / bf16['ms_per_mb']:.2f}x fair bf16)" if bf16 else "")
            + f", {verdict} the {TARGET_RATIO}x target"
            + (
                f"; crossover (compute {cross['compute_s'] * 1e3:.0f} ms + bytes/rate vs plain bytes/rate, "
                f"{cross['method']}): "
                f"TAGC beats fair fp32 below ~{format_rate(int(cross['crossover_bps']))} per rank on this CPU"
                if cross.get("crossover_bps")
                else "; TAGC sends no fewer bytes: no crossover"
            )
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- CLI


def _csv(kind):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return [kind(t) for t in items]
    return parse


def _overlap(text: str) -> bool:
    if text in ("on", "1", "true", "pipe"):
        return True
    if text in ("off", "0", "false", "serial"):
        return False
    raise argparse.ArgumentTypeError(f"overlap must be on/off, got {text!r}")


def _wire(text: str) -> str:
    if text not in WIRES:
        raise argparse.ArgumentTypeError(f"wire must be one of {WIRES}, got {text!r}")
    return text


def _link(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _size(text: str) -> str:
    try:
        bucket(text, 1)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m testbed.exchange", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--link",
        type=_csv(_link),
        default=None,
        help="link rates per rank, e.g. 10gbit,1gbit,100mbit, or none (default: 10gbit,1gbit,100mbit)",
    )
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--sizes",
        type=_csv(_size),
        default=None,
        help=f"buckets: {', '.join(SIZES)} or element counts like 1M (default mlp)",
    )
    p.add_argument("--ratios", type=_csv(float), default=None, help="TAGC ratios (default 2,5,10)")
    p.add_argument("--bits", type=_csv(int), default=None, help="index bits (default 1,4)")
    p.add_argument("--overlap", type=_csv(_overlap), default=None, help="pipelining on/off (default on,off)")
    p.add_argument(
        "--wire",
        type=_csv(_wire),
        default=None,
        help="TAGC's wire: bitmap (index + fp32 sketch), lean (coded positions + bf16 cells) (default bitmap,lean)",
    )
    p.add_argument("--codecs", type=_csv(str), default=[],
                   help="peer codecs to run beside TAGC on the same engine, e.g. bf16,fp8,int4,sign,topk,powersgd")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 5, --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="a smoke run: 256K elements, ratio 10, 1-bit index, 2 rounds")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per link (default 1800)")
    p.add_argument("--pg-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    # worker side (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--link-name", default="none", help=argparse.SUPPRESS)
    p.add_argument("--count-lo", action="store_true", help=argparse.SUPPRESS)
    return p


def _defaults(args) -> None:
    quick = args.quick
    args.link = args.link or (["none"] if quick else ["10gbit", "1gbit", "100mbit"])
    args.sizes = args.sizes or (["256K"] if quick else ["mlp"])
    args.ratios = args.ratios or ([10.0] if quick else [2.0, 5.0, 10.0])
    args.bits = args.bits or ([1] if quick else [1, 4])
    args.overlap = args.overlap or [True, False]
    args.wire = args.wire or ["bitmap", "lean"]
    args.reps = args.reps if args.reps is not None else (2 if quick else 5)
    args.warmup = args.warmup if args.warmup is not None else 1
    from tagc.hooks.codec_registry import codec_names

    unknown = [name for name in args.codecs if name not in codec_names()]
    if unknown:
        raise SystemExit(f"exchange: unknown codec(s) {', '.join(unknown)}: choose from {', '.join(codec_names())}")
    if args.world < 2:
        raise SystemExit("exchange: --world must be >= 2 (a reduce-scatter over one rank moves nothing)")
    if args.reps < 1 or args.warmup < 0:
        raise SystemExit("exchange: --reps must be >= 1 and --warmup >= 0")
    if 4 in args.bits and args.world > 15:
        raise SystemExit("exchange: a 4-bit index counts ranks and is exact for at most 15 ranks")


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Run the benchmark (or, with ``--worker``, one rank of it); returns the rows."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    _defaults(args)
    if args.worker:
        _worker(args)
        return []
    _terminate_cleanly()
    rows: list[dict] = []
    for link_text in args.link:
        try:
            link_rows = run_link(args, link_text)
        except LinkError as err:
            raise SystemExit(f"exchange: cannot emulate link {link_text}: {err}") from None
        print(table(link_rows), flush=True)
        print(flush=True)
        rows.extend(link_rows)
        if args.json:  # keep what is done so far
            _write_json(args.json, rows)
    print(summary(rows), flush=True)
    return rows


def _terminate_cleanly() -> None:
    """SIGTERM unwinds like Ctrl-C, so the ranks are killed and namespaces removed."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _write_json(path: str, rows: list[dict]) -> None:
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    with open(path, "w") as f:
        json.dump(clean, f, indent=1)


if __name__ == "__main__":
    main()
