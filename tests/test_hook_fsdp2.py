"""FSDP2 + TAGC on 2 gloo ranks: same gradients as FSDP2's own reduce-scatter when lossless."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import tagc
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE

pytestmark = pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too


def sparse_embedding_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 16))


def train_embedding(rank, world, use_tagc, reduce_dtype, op_case, steps=3):
    model = sparse_embedding_model()
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in (model, model[0]):
        if op_case == "divide":
            module.set_gradient_divide_factor(3.0)
            module.set_force_sum_reduction_for_comms(not use_tagc)  # gloo has no PREMUL_SUM
        elif op_case == "sum":
            module.set_force_sum_reduction_for_comms(True)
    if use_tagc:
        hook = tagc.hook(dense_steps=0, ratio=10, sparsity=0.0, select="all", min_compress_numel=1024, **PAPER_WIRE)
        tagc.register_comm_hook(model, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(100 + rank)
    for _ in range(steps):
        tokens = torch.randint(0, 4096, (16,))  # each rank touches few embedding rows
        loss = model(tokens).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    result = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    if use_tagc:
        result["stats"] = hook.stats()
    return result


@pytest.mark.parametrize("op_case, reduce_dtype", [
    pytest.param("avg", torch.float32, id="avg-fp32", marks=pytest.mark.slow),
    pytest.param("sum", torch.bfloat16, id="sum-bf16", marks=pytest.mark.slow),
    pytest.param("divide", torch.float32, id="divide-fp32"),
    pytest.param("avg", torch.bfloat16, id="avg-bf16", marks=pytest.mark.slow),
    pytest.param("sum", torch.float32, id="sum-fp32", marks=pytest.mark.slow),
    pytest.param("divide", torch.bfloat16, id="divide-bf16", marks=pytest.mark.slow)])
def test_tagc_matches_default_reduce_scatter_on_sparse_gradients(reduce_dtype, op_case):
    plain = run_ranks(train_embedding, 2, False, reduce_dtype, op_case)
    compressed = run_ranks(train_embedding, 2, True, reduce_dtype, op_case)
    for rank in range(2):
        stats = compressed[rank].pop("stats")
        assert stats["total"]["compressed_buckets"] == 3  # the embedding, every step
        assert stats["total"]["unpeeled"] == 0 and stats["total"]["support"] > 0
        for name, value in plain[rank].items():
            torch.testing.assert_close(compressed[rank][name], value, rtol=1e-6, atol=1e-6, msg=name)


def lambdas_on_fsdp2(rank, world):
    """Two lambdas (both ``<lambda>``) that select different parameters of the same FSDP2 model."""
    from torch.distributed.device_mesh import init_device_mesh

    model = sparse_embedding_model()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    select = (lambda name, module: True) if rank == 0 else (lambda name, module: name.startswith("0."))
    hook = tagc.hook(dense_steps=0, select=select, min_compress_numel=1024)
    tagc.register_comm_hook(model, hook)
    with pytest.raises(ValueError, match="settings differ") as error:
        model(torch.randint(0, 4096, (16,))).square().mean().backward()
    return str(error.value), hook.agreed_settings()["select"]


def test_fsdp2_two_lambdas_selecting_differently_are_an_error_on_every_rank():
    (message0, fingerprint0), (message1, fingerprint1) = run_ranks(lambdas_on_fsdp2, 2)
    assert fingerprint0.startswith("<lambda>: 3 of 3 parameters")
    assert fingerprint1.startswith("<lambda>: 1 of 3 parameters")
    for message in (message0, message1):
        assert "select (this rank '<lambda>: " in message and "pick different parameters or ratios" in message


def test_replicas_gather_wires_on_cuda_only_where_every_replica_decodes_the_same_bits(monkeypatch):
    """HSDP's gathered wires need bit-identical decodes on every replica: the Triton kernels give them
    (no float atomics), the torch reference's CUDA scatter-add only under deterministic algorithms."""
    from types import SimpleNamespace

    from tagc.hooks.adapters import replicas
    from tagc.kernels import dispatch

    cuda_chunk = SimpleNamespace(device=torch.device("cuda"))
    assert replicas.decodes_alike_on_every_replica(torch.zeros(4))
    for backend, deterministic, alike in [("triton", False, True), ("torch", False, False), ("torch", True, True)]:
        monkeypatch.setattr(dispatch, "resolve_backend", lambda *tensors, backend_=backend, **kw: backend_)
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda d=deterministic: d)
        assert replicas.decodes_alike_on_every_replica(cuda_chunk) is alike, (backend, deterministic)
