"""Run a function on several gloo ranks (processes) on this machine, for the tests."""

from __future__ import annotations

import faulthandler
import os
import tempfile
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from testbed.rank_exit import exit_without_teardown


def _entry(rank: int, world: int, out_dir: str, fn: Callable, args: tuple, timeout_s: float, all_finish: bool = True,
           environ: Optional[dict] = None) -> None:
    if environ is not None:  # forked from the fork server: the test's environment, not the server's
        os.environ.clear()
        os.environ.update(environ)
    faulthandler.enable()  # a rank killed by a signal (SIGSEGV, SIGABRT) prints where it was
    torch.set_num_threads(1)
    # a FileStore in the run's own directory: no port to pick, so no race with other processes for one
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if all_finish:  # no rank tears gloo down (rank 0 hosts the store) while a peer still uses it
            dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_teardown()  # after a clean finish: the rare abort in static destructors would fail a passed test


# imported once by the fork server: a rank then starts in ~0.1 s instead of seconds of imports and kernel loads (the
# trainer, the compiler's front end and transformers too: many tests run them in ranks; the CPU kernels from their
# cache); a preload that fails to import is skipped, so nothing here depends on it
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "tagc", "tagc.hooks.core.engine", "fsdp_integration",  # noqa: E501
            "gpt2_bench.train", "torch._dynamo", "torch._functorch.aot_autograd", "transformers", "tests.distributed",
            "tests.warm_kernels")
_READ_AT_IMPORT = ("NUMBA_", "TRITON_", "LD_", "MALLOC_", "GLIBC_", "OMP_", "MKL_", "PYTHON", "CUDA_", "HF_",
                   "TRANSFORMERS_")
"""Variables a library may read when the server imports it: a rank that needs a change to one is spawned."""
_server_environ: dict[str, str] = {}


def _start_method() -> str:
    """``"forkserver"`` (preloaded, fast; the rank then takes the test's environment), or
    ``"spawn"`` when the test changed a variable a preloaded library may have read at import."""
    import multiprocessing
    import multiprocessing.forkserver

    if not _server_environ:
        _server_environ.update(os.environ)
        multiprocessing.set_forkserver_preload(list(_PRELOAD))
    changed = {k for k in set(os.environ) | set(_server_environ) if os.environ.get(k) != _server_environ.get(k)}
    return "spawn" if any(k.startswith(_READ_AT_IMPORT) for k in changed) else "forkserver"


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns each rank's result.

    ``fn`` must be importable (a module-level function). Exceptions in any rank fail the call.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        method = _start_method()
        environ = dict(os.environ) if method == "forkserver" else None
        mp.start_processes(_entry, args=(world, out_dir, fn, args, timeout_s, True, environ), nprocs=world, join=True,
                           start_method=method)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def eager_and_traced_step(eager, traced, grad: torch.Tensor, segments, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of two hooks on one bucket: ``eager`` through ``reduce_scatter``, ``traced`` through
    the compiled path's halves (``encode_bucket``, one all-to-all, ``decode_bucket``). Both end the step."""
    out = torch.empty(chunk)
    eager.reduce_scatter(out, grad.clone(), None, dist.ReduceOp.AVG, segments)
    wire = traced.encode_bucket(grad.clone(), None, segments)
    received = torch.empty_like(wire)
    dist.all_to_all_single(received, wire)
    decoded = traced.decode_bucket(received, None, segments, chunk, torch.float32)
    eager.end_step()
    traced.end_step()
    return out, decoded
