"""Gradient exchange over an emulated link: plain reduce-scatter against TAGC (docs/design.md §10).

``python -m testbed.exchange --link 10gbit,1gbit,100mbit [--world 2] [--sizes mlp,lmhead] [--ratio 10]
[--wire bitmap,lean] [--codecs topk,int4] [--json PATH] [--quick]``

For each link rate the ranks run in their own network namespace whose loopback is shaped
with tbf (:mod:`testbed.link`; ``--link none`` is the plain loopback). On GPT-2-shaped gradient
buckets each rank times, median over ``--reps`` rounds after ``--warmup`` (methods
interleaved round by round so machine-load drift hits them alike):

* ``fair fp32`` / ``fair bf16``: :func:`tagc.hooks.core.transport.plain_reduce_scatter` (all-to-all
  in <= 1 MB pieces + local sum; the (N-1)/N volume of a ring reduce-scatter),
* ``tagc rR``: :meth:`TAGCHook.reduce_scatter` at ratio R with a 1-bit index on the paper's wire (bitmap, float32
  cells); ``tagc rR lean``: the lean wire (``--wire lean``: Elias-Fano coded positions and bf16 sketch cells);
* ``codec NAME`` (``--codecs``): a peer codec on the same engine; ``codec topk lean``: ``topk``
  with the same lean wire (coded positions, bf16 values).

``bits_per_param`` is the wire bits a rank sends per gradient element (of the whole bucket), the
figure the lean wire is judged by (fp32 plain: ``32 (N-1)/N``).

A time is the slowest rank's. ``ms_per_mb`` is per MB (10^6 bytes) of the fp32 gradient a
rank holds (the whole bucket). Wire bytes per rank are counted (TAGC and the peers: the hook's stats;
fair: bytes handed to the all-to-all) and, inside a namespace, also read from the loopback's own byte counter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Optional

from testbed.launch import Launch, torchrun_argv
from testbed.link import LinkError, ShapedLink, format_rate, parse_rate

MB = 1e6
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
    from tagc.hooks.core.engine import MIN_PART
    from tagc.hooks.core.transport import plain_reduce_scatter

    n = chunk * world
    rows = grad.view(world, chunk)
    rows_bf16 = rows.bfloat16()
    out = torch.empty(chunk)
    methods: list[dict] = []
    methods.append(dict(method="fair fp32", kind="fair", dtype="fp32", run=lambda: plain_reduce_scatter(rows, None)[1],
                        wire_source="counted: all-to-all bytes sent"))
    methods.append(dict(method="fair bf16", kind="fair", dtype="bf16", wire_source="counted: all-to-all bytes sent",
                        run=lambda: plain_reduce_scatter(rows_bf16, None)[1]))
    segs = [Segment(name, start, numel) for name, start, numel in segments]
    shaped = [Segment(seg.name, seg.start, seg.numel, shape=_matrix_shape(seg.numel * world)) for seg in segs]
    hooks = []  # (row fields, the hook, its segments, its planned wire bytes per rank or None)
    for wire in args.wire:
        lean = wire == "lean"
        hook = tagc.hook(plain="fp32", feedback="classic", dense_steps=0, ratio=args.ratio, index_bits=1,
                         select="all", min_part=MIN_PART, **(LEAN_OPTIONS if lean else BITMAP_OPTIONS))
        formula = ((world - 1) / world * n * (1 + 32 / args.ratio) / 8 if not lean else
                   (world - 1) * hook.wire_row_bytes(segs, chunk, world, torch.float32))
        fields = dict(method=f"tagc r{args.ratio:g}{' lean' if lean else ''}", kind="tagc", wire=wire,
                      n_parts=len(hook.plan(tuple(segs), chunk, world).compressed_parts))
        hooks.append((fields, hook, segs, formula))
    peers = [(name, {}) for name in args.codecs]
    if "topk" in args.codecs and "lean" in args.wire:  # TAGC's lean wire and settings, the kept values as a list
        peers.append(("topk", {"ratio": args.ratio, "plain": "fp32", "feedback": "classic", **LEAN_OPTIONS}))
    for name, options in peers:  # the peer codecs on the same engine, every column selected
        hook = tagc.hook(codec=name, select="all", dense_steps=0, **options)
        formula = ((world - 1) * hook.wire_row_bytes(shaped, chunk, world, torch.float32)
                   if hook.codec.rounds == 1 else None)  # several rounds: counted only
        hooks.append((dict(method=f"codec {name}{' lean' if options else ''}", kind="codec"), hook, shaped, formula))
    for fields, hook, hook_segments, formula in hooks:
        inp = torch.empty_like(grad)

        def prepare(inp=inp) -> None:
            inp.copy_(grad)  # the hook may use its input as scratch; not timed

        def run(hook=hook, inp=inp, hook_segments=hook_segments) -> int:
            before = hook.total.wire_bytes
            hook.reduce_scatter(out, inp, None, dist.ReduceOp.SUM, hook_segments)
            return hook.total.wire_bytes - before

        methods.append(dict(**fields, dtype="fp32", hook=hook, prepare=prepare, run=run, formula_wire_bytes=formula,
                            wire_source="counted: hook.stats wire_bytes"))
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
        plain_fp32_bytes_per_rank=(world - 1) * chunk * 4, bits_per_param=8 * statistics.median(m["wire"]) / n)
    if m["kind"] != "fair":
        row["formula_wire_bytes"] = m["formula_wire_bytes"]
    if m["kind"] == "tagc":
        deltas = m["deltas"]
        # per-rep times, median (robust to load spikes on a shared machine), then the slowest rank
        worst = torch.tensor([statistics.median(d[k] for d in deltas) for k in ("compress_s", "decode_s", "exposed_s")],
                             dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        counts = torch.tensor([sum(d[k] for d in deltas) for k in ("support", "peeled", "unpeeled", "estimated")],
                              dtype=torch.float64)
        dist.all_reduce(counts)
        support, peeled, unpeeled, estimated = (float(c) for c in counts)
        row.update(ratio=args.ratio, wire=m["wire"], n_parts=m["n_parts"], compress_s=float(worst[0]),
                   decode_s=float(worst[1]), exposed_s=float(worst[2]), compute_s=float(worst[0] + worst[1]),
                   peel_success=peeled / support if support else 1.0, unpeeled=unpeeled, estimated=estimated,
                   support_fraction=support / (len(deltas) * n) if deltas else 0.0)
    return row


# ---------------------------------------------------------------------------- parent: links, tables


def _worker_args(args, out: str, link_name: str, count_lo: bool) -> list[str]:
    argv = ["--worker", "--out", out, "--link-name", link_name, "--world", str(args.world), "--sizes",
            ",".join(args.sizes), "--ratio", f"{args.ratio:g}", "--reps", str(args.reps), "--warmup", str(args.warmup),
            "--threads", str(args.threads), "--pg-timeout", str(args.pg_timeout), "--wire", ",".join(args.wire)]
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
    with tempfile.TemporaryDirectory(prefix="tagc-exchange-") as tmp, contextlib.ExitStack() as stack:
        out = os.path.join(tmp, "rank0.json")
        link = None if rate is None else stack.enter_context(ShapedLink(rate, world=args.world))
        description = "unshaped loopback (this machine's network namespace)" if link is None else link.describe()
        if link is not None:
            print(f"[exchange] {description}", file=sys.stderr, flush=True)
        argv = torchrun_argv("testbed.exchange", _worker_args(args, out, name, link is not None), args.world)
        Launch([argv], env=env, **({} if link is None else {"wrap": lambda host, argv: link.wrap(argv)})).wait(
            deadline_s=args.timeout, grace_s=args.pg_timeout, what="exchange benchmark ranks")
        with open(out) as f:
            rows = json.load(f)
    for row in rows:
        row.update(link=name, link_bps=rate, link_description=description)
    annotate(rows)
    return rows


def annotate(rows: list[dict]) -> None:
    """Add ``ratio_to_fair_baseline``: each row's ms/MB over the fair fp32 exchange's on the same link and bucket."""
    fair = {(r["link"], r["size"]): r for r in rows if r["method"] == "fair fp32"}
    for row in rows:
        base = fair.get((row["link"], row["size"]))
        row["ratio_to_fair_baseline"] = row["ms_per_mb"] / base["ms_per_mb"] if base else None


def _fmt_bytes(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / MB:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def table(rows: list[dict]) -> str:
    """A text table of one link's rows (all sizes)."""
    lines = []
    header = (f"{'method':<26} {'ms/MB':>8} {'x fair':>7} {'wire/rank':>10} {'bits/param':>10} {'lo/rank':>10} "
              f"{'peel':>7} {'compress':>9} {'decode':>8}  note")
    for size in dict.fromkeys(r["size"] for r in rows):
        sub = [r for r in rows if r["size"] == size]
        first = sub[0]
        lines += [f"-- link {first['link']} | bucket {size}: {first['numel'] / 1e6:.2f}M params "
                  f"({first['numel'] * 4 / MB:.1f} MB fp32), world {first['world']}, median of {first['reps']} --",
                  header]
        for r in sub:
            tagc = r["kind"] == "tagc"
            ms = lambda key, r=r, tagc=tagc: format(r[key] * 1e3, ".0f") + " ms" if tagc else "-"  # noqa: E731
            lines.append(f"{r['method']:<26} {r['ms_per_mb']:>8.3f} {r['ratio_to_fair_baseline']:>6.2f}x "
                         f"{_fmt_bytes(r['wire_bytes_per_rank']):>10} {r['bits_per_param']:>10.3f} "
                         f"{_fmt_bytes(r['lo_bytes_per_rank']):>10} "
                         f"{(format(r['peel_success'], '.4f') if tagc else '-'):>7} {ms('compress_s'):>9} "
                         f"{ms('decode_s'):>8}  {(str(r['n_parts']) + ' part(s)') if tagc else ''}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- CLI


def _csv(check=None):
    """A comma-separated list, each item checked by ``check`` (a ValueError is a usage error)."""
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            if not items:
                raise ValueError("empty list")
            return [item if check is None else check(item) for item in items]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def _wire(text: str) -> str:
    if text not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {text!r}")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m testbed.exchange", description=__doc__.split("\n\n")[0])
    p.add_argument("--link", type=_csv(lambda text: (parse_rate(text), text)[1]), default=None,
                   help="link rates per rank, e.g. 10gbit,1gbit,100mbit, or none (default: 10gbit,1gbit,100mbit)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--sizes", type=_csv(lambda text: (bucket(text, 1), text)[1]), default=None,
                   help=f"buckets: {', '.join(SIZES)} or element counts like 1M (default mlp)")
    p.add_argument("--ratio", type=float, default=10.0, help="TAGC's ratio (default 10)")
    p.add_argument("--wire", type=_csv(_wire), default=None,
                   help="TAGC's wire: bitmap (index + fp32 sketch), lean (coded positions + bf16 cells) "
                        "(default bitmap,lean)")
    p.add_argument("--codecs", type=_csv(), default=[],
                   help="peer codecs to run beside TAGC on the same engine, e.g. bf16,fp8,int4,sign,topk,powersgd")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 5, --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="a smoke run: 256K elements, unshaped, 2 rounds")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per link (default 1800)")
    p.add_argument("--pg-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    for internal in ("--worker", "--count-lo"):  # the worker side
        p.add_argument(internal, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--link-name", default="none", help=argparse.SUPPRESS)
    return p


def _defaults(args) -> None:
    quick = args.quick
    args.link = args.link or (["none"] if quick else ["10gbit", "1gbit", "100mbit"])
    args.sizes = args.sizes or (["256K"] if quick else ["mlp"])
    args.wire = args.wire or ["bitmap", "lean"]
    args.reps = args.reps if args.reps is not None else (2 if quick else 5)
    args.warmup = args.warmup if args.warmup is not None else 1
    from tagc.hooks.codecs.registry import codec_names

    unknown = [name for name in args.codecs if name not in codec_names()]
    if unknown:
        raise SystemExit(f"exchange: unknown codec(s) {', '.join(unknown)}: choose from {', '.join(codec_names())}")
    if args.world < 2:
        raise SystemExit("exchange: --world must be >= 2 (a reduce-scatter over one rank moves nothing)")
    if args.reps < 1 or args.warmup < 0:
        raise SystemExit("exchange: --reps must be >= 1 and --warmup >= 0")


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
