"""``python -m tagc.bench gpu-check``: check, on a GPU, what the CPU test suite cannot show.

Without a GPU it says so and exits 0. With one: the kernel tests on the device (:func:`run_kernel_tests`), the
one-GPU self-tests of :data:`CHECKS`, and the kernels' times against a device memcpy (:func:`kernel_times`). Exit
status 1 when a check fails; a check that raises fails with the error in its result, and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from tagc.bench.codec import parse_sizes

NO_GPU = "gpu-check: no CUDA device here ({why}); nothing to check on this machine. Run it where a GPU is visible."


def run_kernel_tests(device: torch.device) -> dict:
    """``pytest tests/test_kernels.py`` on the device (real Triton kernels), every case: the ``slow`` ones too, which
    the CPU's default suite leaves out because the interpreter is slow."""
    tests = Path(__file__).resolve().parents[2] / "tests" / "test_kernels.py"
    if not tests.exists():
        return {"ok": None, "note": f"{tests} not found (not a source checkout): kernel tests skipped"}
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", str(device.index or 0))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", str(tests)],
                            capture_output=True, text=True, env=env, cwd=tests.parents[1])
    tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
    return {"ok": result.returncode == 0, "summary": tail[-1] if tail else "", "tail": tail}


def _exchange(codecs: list, rows: list[torch.Tensor], numel: int) -> tuple[list, list, list, int]:
    """One emulated all-to-all of part ``"k"``: every rank's codec encodes its ``[ranks, numel]`` rows, owner ``o``
    receives row ``o`` of every rank's wire tensors and decodes. Returns the residuals before the encode, the
    decoded parts, their stats and the host reads counted over the exchange."""
    from tagc.hooks.core.stats import ExchangeStats
    from tagc.hooks.core.strict import count_host_reads

    ranks, device = len(codecs), rows[0].device
    before = [c.residuals.get("k", torch.zeros(ranks, numel, device=device)).clone() for c in codecs]
    with count_host_reads() as counted:
        wires = [c.encode(x, "k", None) for c, x in zip(codecs, rows)]
        decoded, stats = [], []
        for owner in range(ranks):
            received = [torch.stack([w[i][owner] for w in wires]) for i in range(len(wires[0]))]
            stats.append(ExchangeStats())
            decoded.append(codecs[owner].decode(received, numel, "k", None, stats[-1]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return before, decoded, stats, counted.count


def _sent(before: list[torch.Tensor], rows: list[torch.Tensor], codecs: list) -> list[torch.Tensor]:
    """What each rank sent (float64): its residual + rows (rounded as compress adds them) less what it kept."""
    return [((b + x) - c.residuals["k"]).double() for b, x, c in zip(before, rows, codecs)]


def codec_round_trip(
    device: torch.device, ranks: int = 4, numel: int = 1 << 20, ratio: float = 10.0, steps: int = 3
) -> dict:
    """Emulated ``ranks``-rank exchange of one part on one GPU through the TAGC codec: the decoded chunk has exactly
    the support the ranks sent and values within float32 rounding of its exact sum; a NaN rank poisons only its part
    and keeps its residual; the steady steps make no host read (strict sync mode)."""
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.registry import make_codec

    config = TAGCConfig(ratio=ratio)
    codecs = [make_codec("tagc", config) for _ in range(ranks)]
    generator = torch.Generator(device=device).manual_seed(0)
    checks, reads = [], []
    for step in range(steps + 1):
        grads = [torch.randn(ranks, numel, device=device, generator=generator) for _ in range(ranks)]
        nan_step = step == steps
        if nan_step:
            grads[1][2, 5] = math.nan  # rank 1's row for owner 2
        before, decoded, stats, host_reads = _exchange(codecs, grads, numel)
        if step > 0:
            reads.append(host_reads)
        if nan_step:  # rank 1 sends NaN tables to every owner: every owner's part is NaN
            checks.append(("a NaN rank poisons the part at every owner", all(bool(d.isnan().all()) for d in decoded)))
            checks.append(("the NaN rank keeps its residual", bool(torch.equal(codecs[1].residuals["k"], before[1]))))
            checks.append(("nonfinite_parts counted", all(s.as_dict()["nonfinite_parts"] == 1 for s in stats)))
            continue
        sent = _sent(before, grads, codecs)
        for owner in range(ranks):
            exact = sum(s[owner] for s in sent)
            got = decoded[owner].double()
            rel = ((got - exact).norm() / max(exact.norm().item(), 1e-30)).item()
            checks.append((f"step {step} owner {owner}: exact support", bool(torch.equal(got != 0, exact != 0))))
            checks.append((f"step {step} owner {owner}: values within fp32 rounding (rel {rel:.1e})", rel <= 1e-6))
    failed = [name for name, ok in checks if not ok]
    return {"ok": not failed and all(r == 0 for r in reads), "host_reads_per_steady_step": reads, "failed": failed,
            "checks": len(checks)}


GPT2_WEIGHTS = ("transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight",
                "transformer.h.0.attn.c_proj.weight", "transformer.wte.weight")
"""The weights the one line compresses in a GPT-2 block, and the tied embedding."""


def gpt2_gradients_round_trip(device: torch.device, ranks: int = 4, steps: int = 3, width: int = 768,
                              layers: int = 12, vocab: int = 50257, tokens: tuple[int, int] = (8, 256)) -> dict:
    """HF GPT-2 (124M shapes, no download): ``ranks`` emulated ranks' own gradients of :data:`GPT2_WEIGHTS` through
    the TAGC codec, ``steps`` times. Per owner: the decoded support within what was sent and holding every
    non-negligible exact sum (cancelling values leave a rounding residue or 0), values within float32 rounding, no
    host reads after the first step. Skipped (``ok`` None) without ``transformers``."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return {"ok": None, "note": "transformers is not installed: GPT-2 check skipped"}
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.registry import make_codec

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=tokens[1], n_embd=width, n_layer=layers,
                                       n_head=max(1, width // 64))).to(device)
    generator = torch.Generator().manual_seed(1)
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in GPT2_WEIGHTS}
    for _ in range(ranks):
        idx = torch.randint(0, vocab, tokens, generator=generator).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model(input_ids=idx, labels=idx).loss.backward()
        for name, param in model.named_parameters():
            if name in grads:
                grads[name].append(param.grad.detach().float().flatten().clone())
        model.zero_grad(set_to_none=True)
    failed, reads, worst = [], [], 0.0
    for name, per_rank in grads.items():
        numel = per_rank[0].numel()
        part = -(-numel // ranks)
        codecs = [make_codec("tagc", TAGCConfig(ratio=10.0)) for _ in range(ranks)]
        for step in range(steps):
            rows = [torch.nn.functional.pad(g * (1 + 0.1 * step), (0, ranks * part - numel)).view(ranks, part)
                    for g in per_rank]
            before, decoded, _, host_reads = _exchange(codecs, rows, part)
            if step > 0:
                reads.append(host_reads)
            sent = _sent(before, rows, codecs)
            for owner in range(ranks):
                exact = sum(s[owner] for s in sent)
                got = decoded[owner].double()
                union = sum((s[owner] != 0).int() for s in sent) > 0
                large = exact.abs() > 1e-6 * exact.abs().max()
                rel = float((got - exact).norm() / exact.norm().clamp_min(1e-30))
                worst = max(worst, rel)
                where = f"{name} step {step} owner {owner}"
                if bool(((got != 0) & ~union).any()):
                    failed.append(f"{where}: decoded outside the sent support")
                if bool((large & (got == 0)).any()):
                    failed.append(f"{where}: an element with a non-negligible sum decoded as 0")
                if not rel <= 1e-6:
                    failed.append(f"{where}: relative error {rel:.1e}")
    return {"ok": not failed and all(r == 0 for r in reads), "failed": failed[:10],
            "host_reads_per_steady_step": reads, "worst_relative_error": worst}


def one_rank_group(device: torch.device) -> dict:
    """A one-rank ``cpu:gloo,cuda:nccl`` group: the hook's start/wait (side stream) and the transport's collectives on
    CUDA buffers (NCCL rejects CPU ones), with strict counting."""
    import torch.distributed as dist

    import tagc
    from tagc.hooks import Segment
    from tagc.hooks.core.transport import all_to_all_rows, gather_from_owners

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # the CPU: a smoke test of this code
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            rows = torch.randn(1, 1 << 16, device=device)
            received = all_to_all_rows(rows, None).wait()
            result["all_to_all"] = bool(torch.equal(received, rows))
            values, _ = gather_from_owners(torch.tensor([1, 5], device=device), rows, None)
            result["gather_from_owners"] = bool(torch.equal(values, rows[0, [1, 5]]))
            os.environ["TAGC_STRICT_SYNC"] = "1"
            hook = tagc.hook(ratio=10, min_compress_numel=1, dense_steps=0)
            n = 1 << 20
            for _ in range(3):
                grad = torch.randn(n, device=device)
                out = torch.empty(n, device=device)
                hook.start(out, grad, None, dist.ReduceOp.AVG, [Segment("mlp.c_fc.weight", 0, n)]).wait()
                hook.end_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result["hook_world1"] = bool(torch.equal(out, grad))
            result["host_reads_last_step"] = hook.stats()["last_step"]["host_reads"]
        finally:
            os.environ.pop("TAGC_STRICT_SYNC", None)
            dist.destroy_process_group()
    result["ok"] = (
        all(v for k, v in result.items() if k != "host_reads_last_step") and result.get("host_reads_last_step") == 0
    )
    return result


def time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernel_times(device: torch.device, sizes: list[int], ratio: float = 10.0, ranks: int = 8) -> list[dict]:
    """Milliseconds of the fused compress and the sync-free decode of one part against a memcpy of
    the bytes each reads (CUDA events)."""
    from tagc.kernels import dispatch
    from tagc.sketch import SketchLayout, plan_density

    rows = []
    density = plan_density(ratio, ranks)
    for numel in sizes:
        layout = SketchLayout(numel, ratio)
        grad = torch.randn(1, numel, device=device)
        residual = torch.zeros(1, numel, device=device)
        index, table = dispatch.compress_(grad, residual.clone(), density, layout, 1)
        # the timed lambdas run at once, in this iteration: binding the tensors as defaults changes nothing
        compress_ms = time_ms(lambda g=grad, r=residual, lay=layout: dispatch.compress_(g, r, density, lay, 1))
        decode_ms = time_ms(lambda t=table, i=index, lay=layout: dispatch.decode_async(t[0], i[0], lay, 1))
        src = torch.empty(numel * 3, device=device)  # compress reads grad and residual, writes residual
        dst = torch.empty_like(src)
        memcpy_ms = time_ms(lambda dst=dst, src=src: dst.copy_(src))
        rows.append({"numel": numel, "compress_ms": compress_ms, "decode_ms": decode_ms, "memcpy_3x_ms": memcpy_ms,
                     "compress_over_memcpy": compress_ms / memcpy_ms, "decode_over_memcpy": decode_ms / memcpy_ms})
    return rows


def callback_memory(device: torch.device, calls: int = 48, numel: int = 16 << 20) -> dict:
    """What the caching allocator reserves for ``calls`` future callbacks that each allocate two temporaries of a
    ``numel``-element bucket, as the DDP hook's decode does: run where torch runs them (the next stream of its
    pool, call after call) and on the hook's own stream (:func:`tagc.hooks.core.callback_stream.on_own_stream`).
    ``ok``: on its own stream the reserve stays within four buckets, whatever ``calls`` is."""
    from tagc.hooks.core.callback_stream import on_own_stream

    bucket = torch.randn(numel, device=device)

    def decode(future: torch.futures.Future) -> torch.Tensor:
        value = future.wait()
        return ((value * 2) + 1).sum()

    reserved = {}
    for where, callback in (("pool", decode), ("own", on_own_stream(decode, device))):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        for _ in range(calls):
            future = torch.futures.Future(devices=[device])
            chained = future.then(callback)
            future.set_result(bucket)
            chained.wait()
        torch.cuda.synchronize(device)
        reserved[where] = torch.cuda.memory_reserved(device) - before
    bucket_bytes = bucket.numel() * bucket.element_size()
    return {"ok": reserved["own"] <= 4 * bucket_bytes, "calls": calls, "bucket_mb": bucket_bytes / 2**20,
            "reserved_mb_pool_streams": reserved["pool"] / 2**20, "reserved_mb_own_stream": reserved["own"] / 2**20}


def counters_across_streams(device: torch.device, rounds: int = 64) -> dict:
    """Counters made on one stream and summed on another, as the DDP hook's future callbacks count on the hook's
    stream and the backward's thread sums on its own (:meth:`tagc.hooks.core.stats.ExchangeStats.count`, ``add``). The
    summing stream is held back (``torch.cuda._sleep``) while the counting stream writes fresh tensors, which is
    when a freed counter's block is handed out again. ``ok``: the :class:`ExchangeStats` sum is exact;
    ``unprotected``: the same sum of bare tensors, whose blocks nothing protects (it may or may not come out wrong:
    the race depends on timing), for comparison."""
    from tagc.hooks.core.stats import ExchangeStats

    counting, summing = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def run(protected: bool) -> int:
        total, bare = ExchangeStats(), torch.zeros((), dtype=torch.int64, device=device)
        for _ in range(rounds):
            with torch.cuda.stream(counting):
                part = ExchangeStats()
                part.count("overflow", torch.ones((), dtype=torch.int64, device=device))
            summing.wait_stream(counting)
            torch.cuda._sleep(2_000_000)
            if protected:
                total.add(part)
            else:
                bare = bare + part.overflow
            del part
            with torch.cuda.stream(counting):
                for _ in range(8):
                    torch.full((), 1 << 40, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        return int(total.overflow if protected else bare)

    counted, unprotected = run(True), run(False)
    return {"ok": counted == rounds, "rounds": rounds, "counted": counted, "unprotected": unprotected}


def _guarded(check, *args):
    """``check(*args)``, or ``{"ok": False, "error": ...}`` when it raises: one check's failure (an out-of-memory
    beside other jobs, a missing package) is reported, and the checks after it still run. The caching
    allocator's cached blocks are released after each check, so that one check's peak does not crowd the next."""
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - reported as the check's result, with its type and message
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


CHECKS = {
    "codec_round_trip": ("codec_round_trip", "codec round trip (4 emulated ranks)"),
    "gpt2_round_trip": ("gpt2_gradients_round_trip", "GPT-2 gradients through the codec (4 emulated ranks)"),
    "one_rank_group": ("one_rank_group", "one-rank NCCL group"),
    "callback_memory": ("callback_memory", "memory reserved by the hook's future callbacks"),
    "counters_across_streams": ("counters_across_streams", "counters made on one stream, summed on another"),
}
"""The self-tests after the kernel tests: result key -> (the check's name in this module, what it prints)."""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tagc.bench gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="the CUDA device to check (default: cuda, the current one)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/test_kernels.py")
    parser.add_argument("--sizes", type=parse_sizes, default="1M,4M,16M",
                        help="part sizes for the times (K/M/G suffixes)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU.format(why=f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
                            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"))
        return 0
    device = torch.device(args.device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    from tagc.kernels import triton_available

    results: dict = {"device": torch.cuda.get_device_name(device),
                     "capability": torch.cuda.get_device_capability(device), "torch": torch.__version__,
                     "triton": triton_available()}
    triton = "yes" if results["triton"] else "NO: the torch reference runs, not sync-free"
    print(f"gpu-check on {results['device']} (sm_{''.join(map(str, results['capability']))}), torch "
          f"{torch.__version__}, triton {triton}")
    if not args.skip_tests:
        results["kernel_tests"] = _guarded(run_kernel_tests, device)
        tests = results["kernel_tests"]
        print(f"kernel tests on the device: {tests.get('summary') or tests.get('note') or tests.get('error')}")
    for name, (check, what) in CHECKS.items():
        results[name] = _guarded(globals()[check], device)
        print(f"{what}: {'ok' if results[name].get('ok') else results[name].get('note') or 'FAILED'} {results[name]}")
    times = _guarded(kernel_times, device, args.sizes)
    results["times"] = times if isinstance(times, list) else []
    if not isinstance(times, list):
        print(f"kernel times: FAILED {times}")
    for row in results["times"]:
        print(f"  {row['numel']:>10,} elements: compress {row['compress_ms']:.3f} ms "
              f"({row['compress_over_memcpy']:.1f}x memcpy), decode {row['decode_ms']:.3f} ms "
              f"({row['decode_over_memcpy']:.1f}x); memcpy of 3x the part {row['memcpy_3x_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    failed = [name for name in ("kernel_tests", *CHECKS)
              if results.get(name, {}).get("ok") is False] + ([] if isinstance(times, list) else ["times"])
    print("gpu-check: " + ("all checks passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
