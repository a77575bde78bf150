"""Ready for GPUs, checked on the CPU: collective buffers on the input's device, no host reads
in a steady exchange (strict sync mode), the trainer's and gpu-check's behaviour without a GPU.

What these tests cannot show (they run on one CPU, gloo, one program at a time): races between
CUDA streams, NCCL's own requirements beyond tensor devices, the order of atomic adds on a
device, and real barriers. ``python -m tagc.bench gpu-check`` is for those, on a GPU.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.hooks import Segment
from tests.distributed import run_ranks
from tests.paper_wire import paper

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "tagc" / "hooks"
FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "randn",
    "rand",
    "randint",
    "as_tensor",
    "linspace",
    "eye",
}

ALLOWED_HOST_FACTORIES = {
    # (file, enclosing function): why the tensor never feeds a collective
    ("plan.py", "_columns"): "a plan's column list (device-free plans); indexes go through Part.index(device)",
    ("plan.py", "batch"): "a batch's column list (device-free plans); indexes go through Part.index(device)",
    (
        "powersgd.py",
        "_q",
    ): "drawn from a host generator (the same Q on every device type), moved .to(device) before use",
    ("powersgd.py", "state_dict"): "a checkpoint counter, never exchanged",
    ("quantized.py", "state_dict"): "a checkpoint counter, never exchanged",
    (
        "replicas.py",
        "build",
    ): "an HSDP shard's piece layout, built once per shard size on the host, moved .to(device) before use",
    ("describe.py", "_column_bytes"): "hook.describe's report: planned bytes per column, on the host, never exchanged",
    (
        "describe.py",
        "_segment_codecs",
    ): "hook.describe's report: which part owns each column, on the host, never exchanged",
}
"""Tensor factories in tagc/hooks allowed on the host (no ``device=``, or ``device="cpu"``)."""


def _host_factories() -> list[tuple[str, str, int, str]]:
    """``(file, function, line, call)`` of every torch tensor factory in tagc/hooks made without
    ``device=`` or with a literal CPU device."""
    found = []
    for path in sorted(HOOKS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                continue
            device = next((k.value for k in node.keywords if k.arg == "device"), None)
            on_host = device is None or (isinstance(device, ast.Constant) and str(device.value).startswith("cpu"))
            if not on_host:
                continue
            scope, up = "<module>", node
            while up in parents:
                up = parents[up]
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    scope = up.name
                    break
            found.append((path.name, scope, node.lineno, ast.unparse(node)[:80]))
    return found


def test_no_tensor_factory_in_the_hooks_is_on_the_host_by_accident():
    found = _host_factories()
    unexplained = [f for f in found if (f[0], f[1]) not in ALLOWED_HOST_FACTORIES]
    assert not unexplained, "tensor factories without device= in tagc/hooks (NCCL takes no CPU tensor):\n" + "\n".join(
        f"  {file}:{line} in {scope}: {call}" for file, scope, line, call in unexplained)
    stale = set(ALLOWED_HOST_FACTORIES) - {(f[0], f[1]) for f in found}
    assert not stale, f"allow-list entries with nothing left to allow: {stale}"


def test_the_static_check_finds_a_factory_without_device(tmp_path, monkeypatch):
    (tmp_path / "bad.py").write_text(
        "import torch\n\ndef flag():\n    return torch.tensor([1])\n\n"
        "def ok(x):\n    return torch.zeros(1, device=x.device)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "HOOKS", tmp_path)
    assert [(f[0], f[1]) for f in _host_factories()] == [("bad.py", "flag")]


# ---------------------------------------------------------------- collectives see the input's device

CHUNK = 40_000
COLLECTIVES = ("all_to_all_single", "all_gather", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "reduce", "gather", "scatter", "all_to_all", "send", "recv", "isend", "irecv")


def _segments():
    return [Segment("mlp.c_fc.weight", 0, CHUNK - 500), Segment("mlp.c_fc.bias", CHUNK - 500, 500)]


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def collectives_seen(rank, world, settings_list):
    """Wrap torch.distributed's collectives (what the transport calls) and record every tensor's device."""
    seen = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def collective(*args, **kwargs):
            for t in _tensors(list(args) + list(kwargs.values())):
                seen.append((name, t.device))
            return fn(*args, **kwargs)
        return collective

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        results = []
        for settings in settings_list:
            hook = tagc.hook(**{"dense_steps": 0, **settings})
            torch.manual_seed(rank)
            for step in range(2):
                grad = torch.randn(world * CHUNK)
                if step == 1 and rank == 1:
                    grad[7] = float("nan")  # the NaN path too
                out = torch.empty(CHUNK)
                mark = len(seen)
                hook.start(out, grad, None, dist.ReduceOp.AVG, _segments()).wait()
                hook.end_step()
                results.append((settings.get("codec", "tagc"), grad.device, seen[mark:]))
        return results
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


SMALL = paper(ratio=10, min_compress_numel=1000)  # codec tagc on the paper's wire (the others override it)
LEAN = dict(positions="coded", value_dtype="bfloat16", plain="bf16")
RECOMMENDED = dict(min_compress_numel=1000, min_part=1 << 14)  # tagc.hook()'s: EF21, coded, float16, int4 plain
SETTINGS = [dict(SMALL, min_part=1 << 14), dict(SMALL, fallback="raw", min_part=1 << 14),
            dict(ratio=10, min_compress_numel=1000, codec="topk"), dict(codec="bf16", select="all"),
            dict(codec="plain", select="all"), dict(SMALL, min_part=1 << 14, **LEAN), RECOMMENDED]


def test_every_collective_tensor_is_on_the_gradients_device():
    for rank_results in run_ranks(collectives_seen, 2, SETTINGS):
        names = set()
        for codec, device, seen in rank_results:
            assert seen, f"{codec}: no collective seen (the wrapper is not in the transport's path)"
            wrong = [(name, d) for name, d in seen if d != device]
            assert not wrong, f"{codec}: collective tensors off the gradient's device {device}: {wrong}"
            names |= {name for name, _ in seen}
        assert {"all_to_all_single", "all_gather"} <= names  # the raw re-send's gathers were checked too


# ---------------------------------------------------------------- strict sync mode


def strict_steps(rank, world, settings, steps, nan_step):
    os.environ["TAGC_STRICT_SYNC"] = "1"
    hook = tagc.hook(**{"dense_steps": 0, **settings})
    assert hook.strict_sync
    torch.manual_seed(rank)
    per_step = []
    for step in range(steps):
        grad = torch.randn(world * CHUNK)
        if step == nan_step and rank == 0:
            grad[3] = float("inf")
        out = torch.empty(CHUNK)
        hook.start(out, grad, None, dist.ReduceOp.AVG, _segments()).wait()
        hook.end_step()
        per_step.append(hook.stats()["last_step"])
    return per_step, dict(hook.host_read_sites)



@pytest.mark.parametrize("settings", [dict(codec="plain", select="all"), dict(SMALL, min_part=1 << 14),
                                      dict(ratio=10, min_compress_numel=1000, codec="topk"),
                                      dict(SMALL, min_part=1 << 14, **LEAN),
                                      dict(ratio=10, min_compress_numel=1000, codec="topk", **LEAN), RECOMMENDED],
                         ids=["plain", "tagc", "topk", "tagc-lean", "topk-lean", "tagc-recommended"])
def test_strict_sync_steady_exchange_reads_nothing_on_the_host(settings):
    steps, nan_step = 4, 3
    for per_step, sites in run_ranks(strict_steps, 2, settings, steps, nan_step):
        assert per_step[0]["host_reads"] > 0, "the first step plans buckets (host reads): the counter must see them"
        steady = [s["host_reads"] for s in per_step[1:]]
        assert steady == [0] * (steps - 1), f"host reads per steady step {steady}; where: {sites}"
        if settings.get("codec", "tagc") != "plain":
            assert per_step[nan_step]["nonfinite_parts"] > 0 and per_step[1]["nonfinite_parts"] == 0
        if settings.get("codec", "tagc") == "tagc":
            assert per_step[1]["support"] > 0 and per_step[1]["peeled"] == per_step[1]["support"]


def test_strict_mode_counts_each_kind_of_host_read():
    from tagc.hooks.core.strict import count_host_reads

    x = torch.arange(4.0)
    with count_host_reads() as reads:
        bool(x[1]), x[1].item(), int(x[2]), float(x[3]), x.tolist(), [0, 1, 2][x.long()[1]], f"{x[0]}"
    assert reads.count == 7 and reads.backend == 0
    assert "item" not in vars(torch.Tensor)  # unpatched after the window


def nan_residual(rank, world):
    """Under the device-side policy the poisoned rank's residual stays as it was, bit for bit."""
    hook = tagc.hook(**{"dense_steps": 0, **SMALL})  # one compressed part
    torch.manual_seed(rank)
    out = torch.empty(CHUNK)
    hook.start(out, torch.randn(world * CHUNK), None, dist.ReduceOp.AVG, _segments()).wait()
    before = [r.clone() for parts in hook.residuals.values() for r in parts]
    grad = torch.randn(world * CHUNK)
    if rank == 0:
        grad[11] = float("nan")
    hook.start(out, grad, None, dist.ReduceOp.AVG, _segments()).wait()
    after = [r.clone() for parts in hook.residuals.values() for r in parts]
    return before, after, out


def test_device_side_nan_policy_keeps_the_poisoned_ranks_residual():
    (before0, after0, out0), (before1, after1, out1) = run_ranks(nan_residual, 2)
    assert all(torch.equal(a, b) for a, b in zip(before0, after0))
    assert not all(torch.equal(a, b) for a, b in zip(before1, after1))  # the finite rank sent and kept the rest
    for out in (out0, out1):
        compressed = out[: CHUNK - 500]
        assert torch.isnan(compressed).all() and torch.isfinite(out[CHUNK - 500:]).all()


# ---------------------------------------------------------------- no GPU here: clear answers


needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


@needs_no_gpu
def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    result = subprocess.run(
        [sys.executable, "-m", "tagc.bench", "gpu-check"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "no CUDA device" in result.stdout


@needs_no_gpu
def test_train_device_cuda_without_a_gpu_fails_clearly(tmp_path):
    from gpt2_bench.train import main

    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["--device", "cuda", "--preset", "tiny", "--steps", "1", "--out-dir", str(tmp_path)])


def test_train_device_resolution():
    from gpt2_bench.train import resolve_device

    assert resolve_device("cpu") == ("cpu", "gloo")
    assert resolve_device("auto") == (("cuda", "cpu:gloo,cuda:nccl") if torch.cuda.is_available() else ("cpu", "gloo"))
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")


def test_gpu_check_self_tests_run_on_the_cpu_device():
    """The self-tests' own code, run on the CPU (a smoke test of gpu-check, not proof of the GPU path)."""
    from tagc.bench import gpu_check

    trip = gpu_check.codec_round_trip(torch.device("cpu"), ranks=3, numel=1 << 15)
    assert trip["ok"] and trip["host_reads_per_steady_step"] == [0, 0, 0], trip
    assert gpu_check.one_rank_group(torch.device("cpu"))["ok"]


def test_gpu_check_gpt2_round_trip_runs_and_can_fail(monkeypatch):
    """The GPT-2 check on a tiny GPT-2 on the CPU, and the same check failing when the decoded values are off."""
    pytest.importorskip("transformers")
    from tagc.bench import gpu_check
    from tagc.hooks.codecs.codec import TAGCCodec

    tiny = dict(ranks=3, steps=2, width=64, layers=1, vocab=1024, tokens=(2, 32))
    trip = gpu_check.gpt2_gradients_round_trip(torch.device("cpu"), **tiny)
    assert trip["ok"] and trip["host_reads_per_steady_step"] == [0] * 4 and trip["worst_relative_error"] < 1e-6, trip
    decode = TAGCCodec.decode
    monkeypatch.setattr(TAGCCodec, "decode", lambda self, *a, **k: decode(self, *a, **k) * 1.001)
    off = gpu_check.gpt2_gradients_round_trip(torch.device("cpu"), **{**tiny, "steps": 1})
    assert off["ok"] is False and any("relative error" in f for f in off["failed"]), off


def test_gpu_check_reports_a_check_that_raises_and_runs_the_rest(monkeypatch, capsys):
    """One check raising (an out-of-memory beside other jobs) is that check's failure: the checks after it still run,
    the results say what was raised, and the exit status is 1. The device calls are stubbed: no GPU is needed."""
    from tagc.bench import gpu_check

    for name, value in [("is_available", lambda: True), ("current_device", lambda: 0), ("set_device", lambda d: None),
                        ("get_device_name", lambda d: "stub GPU"), ("get_device_capability", lambda d: (9, 0)),
                        ("empty_cache", lambda: None)]:
        monkeypatch.setattr(torch.cuda, name, value)
    ran = []

    def passes(name):
        def check(*args):
            ran.append(name)
            return {"ok": True}
        return check

    def out_of_memory(*args):
        ran.append("codec_round_trip")
        raise RuntimeError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(gpu_check, "codec_round_trip", out_of_memory)
    for name in ("gpt2_gradients_round_trip", "one_rank_group", "callback_memory", "counters_across_streams"):
        monkeypatch.setattr(gpu_check, name, passes(name))
    monkeypatch.setattr(gpu_check, "kernel_times", lambda device, sizes: ran.append("kernel_times") or [])
    assert gpu_check.main(["--skip-tests"]) == 1
    assert ran == ["codec_round_trip", "gpt2_gradients_round_trip", "one_rank_group", "callback_memory",
                   "counters_across_streams", "kernel_times"]
    out = capsys.readouterr().out
    assert "RuntimeError: CUDA out of memory" in out and "FAILED: codec_round_trip" in out
    assert gpu_check._guarded(lambda: {"ok": True}) == {"ok": True}
