"""What a GPU machine with another torch, or without the experiments' packages, still runs.

A lent GPU may carry an older torch (2.11, without ``dist.all_gather_single`` and
``_functional_collectives.all_gather_single``) and no ``tiktoken``: the DDP runs must not import SimpleFSDP,
whose torch internals are checked at import, and must reach their gathers through the name that torch has.
``--device cuda-shared`` puts every rank of a DDP run on one GPU over gloo, for quality runs of several ranks
on a single lent GPU.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from tests.source_tree import ROOT

OLDER_TORCH = textwrap.dedent("""
    import sys, types
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    del funcol.all_gather_single, dist.all_gather_single, dist.reduce_scatter_single
    sys.modules["tiktoken"] = None  # import tiktoken -> ImportError
""")


def test_the_trainer_and_the_ddp_hook_import_on_an_older_torch_without_tiktoken(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(OLDER_TORCH)
    probe = textwrap.dedent("""
        import torch.distributed as dist
        assert not hasattr(dist, "all_gather_single")
        import gpt2_bench.train, gpt2_bench.host_bytes, gpt2_bench.data
        import tagc.hooks.adapters.ddp, tagc.hooks.adapters.replicas
        assert "fsdp_integration" not in __import__("sys").modules, "a DDP run imports SimpleFSDP"
        from gpt2_bench.assets import DataError
        from gpt2_bench.tokenizer import get_tokenizer
        try:
            get_tokenizer()
        except DataError as err:
            assert "pip install tiktoken" in str(err), err
        else:
            raise AssertionError("no tokenizer without tiktoken")
        print("ok")
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("has_single", [True, False])
def test_all_gather_single_takes_the_name_this_torch_has(monkeypatch, has_single):
    from tagc.hooks.core import transport

    calls = []

    def recorder(name):
        def collective(output, input, group=None, async_op=False):
            calls.append((name, output, input, group, async_op))
        return collective

    monkeypatch.setattr(dist, "all_gather_into_tensor", recorder("all_gather_into_tensor"))
    if has_single:
        monkeypatch.setattr(dist, "all_gather_single", recorder("all_gather_single"))
    else:
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
    out, inp = torch.zeros(4), torch.ones(2)
    transport.all_gather_single(out, inp, group="g", async_op=True)
    assert calls == [("all_gather_single" if has_single else "all_gather_into_tensor", out, inp, "g", True)]


def test_gathers_and_reduce_scatters_go_through_the_version_shims():
    """``dist.all_gather_single`` / ``reduce_scatter_single`` are torch 2.13's names, their older ones deprecated
    there: the library calls either only inside :mod:`tagc.hooks.core.transport`'s shims."""
    names = {"all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"}
    found = []
    for path in sorted((ROOT / "tagc").rglob("*.py")):
        if path.name == "transport.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
                    and node.value.id == "dist"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} dist.{node.attr}")
    assert not found, found


def test_cuda_shared_is_ddp_on_one_host_only():
    from gpt2_bench.config import TrainConfig

    TrainConfig(device="cuda-shared", integration="ddp")  # builds: the GPU is looked for when the run starts
    for bad in ({"integration": "simple"}, {"integration": "fsdp2"}, {"integration": "ddp", "world": 4, "hosts": 2}):
        with pytest.raises(ValueError, match="cuda-shared.*ddp"):
            TrainConfig(device="cuda-shared", **bad)


def test_cuda_shared_resolves_to_gloo_on_gpu_0(monkeypatch):
    from gpt2_bench import train

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [train.gpu_index("cuda-shared", rank) for rank in range(3)] == [0, 0, 0]
    assert [train.gpu_index("cuda", rank) for rank in range(3)] == [0, 1, 2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.resolve_device("cuda-shared") == ("cuda", "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--device cuda-shared: no CUDA device"):
        train.resolve_device("cuda-shared")
