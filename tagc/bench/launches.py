"""Host work per bucket: aten ops dispatched and kernel launches, against the number of compressed parts (issue 61).

``python -m tagc.bench launches [--parts 1,8,64] [--backends triton,numba,torch] [--wires default,paper] [--json FILE]``

One bucket of ``--parts`` compressed parts exchanged by a real :func:`tagc.hook` on 2 gloo ranks; after ``--warm``
compressed steps, one steady step's ops are counted (:class:`HostWork`) by phase (``encode``, ``decode`` of the
compressed parts, ``other``) and namespace, and the Triton back end's kernel launches (in its interpreter: the
launches a GPU makes). The target: the counts do not grow with the parts. What it measures and the tables:
docs/design.md, section 3.1 ("Batches of parts"). ``triton`` at 64 parts takes tens of minutes on a small CPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PARTS = (1, 8, 64)
BACKENDS = ("triton", "numba", "torch")
WIRES: dict[str, dict[str, Any]] = {
    "default": {},
    "paper": {"ratio": 10, "plain": "fp32", "feedback": "classic", "positions": "bitmap", "value_dtype": "float32"},
}
"""``tagc.hook(**WIRES[name])``: the default wire, and the TAGC paper's."""
PART_NUMEL = 4096
"""Columns of one compressed part (small: the Triton interpreter runs every program in Python)."""
WORLD = 2
PHASES = ("encode", "decode", "other")


class HostWork(TorchDispatchMode):
    """Counts the ops dispatched while it is open, by phase (:meth:`phase`) and namespace, and the kernel launches
    (:meth:`launch`). A custom op counts once and its body's ops too; ops dispatched inside a launch (the Triton
    interpreter's copies of the arguments) do not count."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch.compile here: spare every op torch._dynamo.disable's wrapper (and its import)

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        """``(phase, namespace) -> ops``."""
        self.names: collections.Counter = collections.Counter()
        """``(phase, op) -> ops``."""
        self.launches: collections.Counter = collections.Counter()
        """``(phase, kernel name) -> launches``."""
        self._phase = "other"
        self._in_kernel = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs in the block under phase ``name`` (the outermost phase wins)."""
        outer = self._phase
        self._phase = name if outer == "other" else outer
        try:
            yield
        finally:
            self._phase = outer

    def launch(self, name: str, run: Callable, *args, **kwargs):
        """Run a kernel launch, counted; the ops it dispatches are not."""
        self.launches[(self._phase, name)] += 1
        self._in_kernel += 1
        try:
            return run(*args, **kwargs)
        finally:
            self._in_kernel -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._in_kernel:
            self.ops[(self._phase, func.namespace)] += 1
            self.names[(self._phase, func)] += 1
        if func.namespace not in ("aten", "prim", "c10d", "_c10d_functional"):
            body = _custom_body(func)
            if body is not None:
                with self:  # count the body's ops too
                    return body(*args, **kwargs)
        return func(*args, **kwargs)

    def count(self, phase: str, namespace: str = "aten") -> int:
        return self.ops[(phase, namespace)]

    def launch_count(self, phase: Optional[str] = None) -> int:
        return sum(n for (p, _), n in self.launches.items() if phase in (None, p))

    def summary(self) -> dict[str, Any]:
        namespaces = sorted({ns for _, ns in self.ops})
        return {
            "aten_ops": {phase: self.count(phase) for phase in PHASES},
            "ops": {phase: {ns: self.ops[(phase, ns)] for ns in namespaces if self.ops[(phase, ns)]}
                    for phase in PHASES},
            "launches": {phase: self.launch_count(phase) for phase in PHASES},
            "kernels": {phase: dict(sorted((name, n) for (p, name), n in self.launches.items() if p == phase))
                        for phase in PHASES},
            "top_ops": {phase: dict(collections.Counter({str(func): n for (p, func), n in self.names.items()
                                                         if p == phase}).most_common(12))
                        for phase in PHASES},
        }


def _custom_body(func) -> Optional[Callable]:
    """The Python body of a ``torch.library.custom_op`` (``None`` for another op)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func.name().partition(".")[0])  # "namespace::op" (a custom op has one overload)
    return None if opdef is None else opdef._init_fn


def _counting_wrap(work: HostWork, wrap: Callable) -> Callable:
    """A ``wrap`` for the launchers of :mod:`tagc.kernels` (``wrap(kernel)[grid](...)``) that counts each launch
    in ``work`` and then launches through ``wrap``."""

    def counting(kernel):
        wrapped = wrap(kernel)
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))

        class _Grid:
            def __getitem__(self, grid):
                run = wrapped[grid]
                return functools.partial(work.launch, name, run)

        return _Grid()

    return counting


@contextlib.contextmanager
def instrument(work: HostWork) -> Iterator[HostWork]:
    """Open ``work`` with the exchange's phases marked (:class:`tagc.hooks.core.exchange.PartCoder`'s ``encode`` and
    ``decode`` of compressed parts) and the Triton launches counted (when :mod:`tagc.kernels.ops` is in use)."""
    from tagc.hooks.core.exchange import PartCoder

    encode, decode = PartCoder.encode, PartCoder.decode

    def phased(method: Callable, name: str) -> Callable:
        @functools.wraps(method)
        def run(self, part, *args, **kwargs):
            with work.phase(name) if part.codec.compresses else contextlib.nullcontext():
                return method(self, part, *args, **kwargs)

        return run

    ops = sys.modules.get("tagc.kernels.ops")
    wrap = getattr(ops, "_wrap", None)
    PartCoder.encode, PartCoder.decode = phased(encode, "encode"), phased(decode, "decode")
    if ops is not None:
        ops._wrap = _counting_wrap(work, wrap)
    try:
        with work:
            yield work
    finally:
        PartCoder.encode, PartCoder.decode = encode, decode
        if ops is not None:
            ops._wrap = wrap


# ---------------------------------------------------------------- one bucket, on every rank


def make_hook(wire: str, part_numel: int):
    """A hook of wire ``wire`` (:data:`WIRES`) whose compressed parts have ``part_numel`` columns, every column
    compressed from the first step."""
    import tagc

    return tagc.hook(**WIRES[wire], select="all", min_part=part_numel, min_compress_numel=1, dense_steps=0)


def count_bucket(wire: str, parts: int, part_numel: int = PART_NUMEL, warm: int = 1) -> dict[str, Any]:
    """Exchange one bucket of ``parts`` compressed parts ``warm + 1`` times (every rank of the default group
    must call it alike); the counts of the last exchange (:meth:`HostWork.summary`)."""
    import torch.distributed as dist

    from tagc.hooks import Segment

    if "tagc.kernels.ops" not in sys.modules and os.environ.get("TAGC_BACKEND", "").lower() == "triton":
        import tagc.kernels.ops  # noqa: F401  (its _wrap is what instrument() counts through)
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = parts * part_numel
    segments = [Segment(f"layer{k}.weight", k * part_numel, part_numel) for k in range(parts)]
    hook = make_hook(wire, part_numel)
    plan = hook.plan(tuple(segments), chunk, world)
    if len(plan.compressed_parts) != parts or len(plan.parts) != parts:
        raise RuntimeError(f"planned {len(plan.compressed_parts)} compressed parts of {len(plan.parts)}, "
                           f"expected {parts}")
    out = torch.empty(chunk)
    work = HostWork()
    for step in range(warm + 1):
        grad = torch.randn(world, chunk, generator=torch.Generator().manual_seed(1000 * rank + step))
        with instrument(work) if step == warm else contextlib.nullcontext():
            hook.reduce_scatter(out, grad.view(-1), None, dist.ReduceOp.AVG, segments)
            hook.end_step()
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError("the exchange returned NaN/Inf")
    from tagc.kernels.dispatch import resolve_backend

    return {"backend": resolve_backend(torch.empty(0)), "wire": wire, "parts": parts, "part_numel": part_numel,
            **work.summary()}


def rank_counts(rank: int, world: int, wires: list[str], parts: list[int], part_numel: int = PART_NUMEL,
                warm: int = 1, repeats: int = 1) -> list[dict[str, Any]]:
    """:func:`count_bucket` for every wire and part count, ``repeats`` times each (fresh hooks), on one rank."""
    return [count_bucket(wire, n, part_numel, warm) for wire in wires for n in parts for _ in range(repeats)]


# ---------------------------------------------------------------- the ranks


def _rank(rank: int, world: int, store_dir: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(store_dir, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=1800))
    try:
        torch.save(fn(rank, world, *args), os.path.join(store_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's static destructors, which sometimes abort after a clean finish


def run_ranks(fn: Callable, world: int, *args, environ: Optional[dict[str, str]] = None) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks (spawned, with ``environ`` added to the environment);
    every rank's result."""
    from unittest import mock

    import torch.multiprocessing as mp

    with mock.patch.dict(os.environ, environ or {}), tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank, args=(world, store_dir, fn, args), nprocs=world, join=True, start_method="spawn")
        return [torch.load(os.path.join(store_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def available(backend: str) -> Optional[str]:
    """``None`` when ``backend`` can run here, else why not."""
    from tagc.kernels import triton_available
    from tagc.kernels.cpu import numba_available

    works = {"triton": triton_available, "numba": numba_available}.get(backend, lambda: True)()
    return None if works else f"{backend} does not import"


# ---------------------------------------------------------------- the table


def row_cells(row: dict[str, Any]) -> dict[str, int]:
    """A result row's table cells."""
    return {"encode ops": row["aten_ops"]["encode"], "decode ops": row["aten_ops"]["decode"],
            "other ops": row["aten_ops"]["other"],
            "launches": row["launches"]["encode"] + row["launches"]["decode"] + row["launches"]["other"]}


def table(rows: list[dict[str, Any]]) -> str:
    """Back end x wire x parts: aten ops in encode and decode (and the rest of the exchange), kernel launches."""
    head = ["backend", "wire", "parts", "encode ops", "decode ops", "other ops", "launches"]
    lines = [head]
    for row in rows:
        cells = row_cells(row)
        lines.append([row["backend"], row["wire"], str(row["parts"])] + [str(cells[h]) for h in head[3:]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))) for line in lines)


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated, got {text!r}")
    return values


def _names(allowed) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return names

    return parse


def _write(path: str, args: argparse.Namespace, rows: list, ranks: dict, skipped: dict,
           argv: Optional[list[str]]) -> None:
    command = "python -m tagc.bench launches " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(path, "w") as f:
        json.dump({"command": command.strip(), "world": WORLD, "part_numel": args.part_numel, "warm": args.warm,
                   "rows": rows, "ranks": ranks, "skipped": skipped}, f, indent=1)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the count (see ``--help``)."""
    parser = argparse.ArgumentParser(prog="python -m tagc.bench launches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=_ints, default=list(PARTS), help="compressed parts per bucket (default 1,8,64)")
    parser.add_argument("--backends", type=_names(BACKENDS), default=list(BACKENDS),
                        help="back ends (default triton,numba,torch; triton runs in its interpreter)")
    parser.add_argument("--wires", type=_names(WIRES), default=list(WIRES),
                        help="wires: default (tagc.hook()) and paper (default both)")
    parser.add_argument("--part-numel", type=int, default=PART_NUMEL, help=f"columns per part (default {PART_NUMEL})")
    parser.add_argument("--warm", type=int, default=1, help="compressed steps before the counted one (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write every count, per rank, here")
    args = parser.parse_args(argv)
    rows, skipped, ranks = [], {}, {}
    for backend in args.backends:
        why = available(backend)
        if why is not None:
            skipped[backend] = why
            print(f"skipping back end {backend}: {why}", file=sys.stderr)
            continue
        start = time.perf_counter()
        environ = {"TAGC_BACKEND": backend, **({"TRITON_INTERPRET": "1"} if backend == "triton" else {})}
        results = run_ranks(rank_counts, WORLD, args.wires, args.parts, args.part_numel, args.warm, environ=environ)
        if any(row["backend"] != backend for result in results for row in result):
            raise RuntimeError(f"the ranks did not run back end {backend!r}")
        ranks[backend] = results
        rows += results[0]
        print(f"back end {backend}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        if args.json:  # after every back end: a long run keeps what it measured
            _write(args.json, args, rows, ranks, skipped, argv)
    print(table(rows))
    if args.json:
        _write(args.json, args, rows, ranks, skipped, argv)
    return 0
