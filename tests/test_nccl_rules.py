"""NCCL's rules on the CPU (:mod:`tests.nccl_rules`): the stand-in catches what a first GPU run would
reject, and the SimpleFSDP, FSDP2 and FSDP1 exchanges keep those rules (wrapping, registration, steps)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

import tagc
from tests.distributed import run_ranks
from tests.nccl_rules import NcclRules
from tests.paper_wire import paper

STEPS = 3


# ---------------------------------------------------------------- the stand-in itself


def _old_settings_check(model: nn.Module) -> None:
    """The pattern of SimpleFSDP's old weight check: sums moved to the host, all-reduced on the default group."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu()
    dist.all_reduce(sums, op=dist.ReduceOp.MAX)


def stand_in_cases(rank, world):
    model = nn.Linear(4, 4)
    found = {}
    for case in ("host_all_reduce", "default_device_factory", "device_factory", "object_collective",
                 "functional_on_host", "moved_to_device", "read_outside", "read_inside", "nonzero_inside",
                 "host_read_inside"):
        rules = NcclRules(watch=(__file__,))  # this file plays the code under test
        with rules:
            x = model.weight.detach()  # made before the rules opened: a device tensor
            if case == "host_all_reduce":
                _old_settings_check(model)
            elif case == "default_device_factory":
                dist.all_reduce(torch.zeros(3))
            elif case == "device_factory":
                dist.all_reduce(torch.zeros(3, device=x.device) + x.sum())
            elif case == "object_collective":
                everyone = [None] * world
                dist.all_gather_object(everyone, {"rank": rank})
            elif case == "functional_on_host":
                funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD))
            elif case == "moved_to_device":
                dist.all_reduce(torch.ones(2).to(x.device))
            elif case == "read_outside":
                x.sum().item()  # not in an exchange window: setup may read
            elif case == "read_inside":
                with rules.exchange():
                    x.sum().item()
            elif case == "nonzero_inside":
                with rules.exchange():
                    x.nonzero()
            elif case == "host_read_inside":
                with rules.exchange():
                    torch.arange(4).tolist()  # a host tensor: free
        found[case] = (rules.violations, dict(rules.collectives))
    return found


def test_the_stand_in_rejects_host_tensors_in_collectives_and_device_reads():
    found = run_ranks(stand_in_cases, 2)[0]
    assert any("all_reduce on a host tensor" in v and "_old_settings_check" not in v and "test_nccl_rules.py" in v
               for v in found["host_all_reduce"][0]), found["host_all_reduce"]
    assert found["default_device_factory"][0] and "all_reduce on a host tensor" in found["default_device_factory"][0][0]
    assert found["functional_on_host"][0] and "functional all_reduce" in found["functional_on_host"][0][0]
    assert found["read_inside"][0] and "host read .item() of a device tensor" in found["read_inside"][0][0]
    assert found["nonzero_inside"][0] and "nonzero" in found["nonzero_inside"][0][0]
    for legal in ("device_factory", "object_collective", "moved_to_device", "read_outside", "host_read_inside"):
        assert found[legal][0] == [], (legal, found[legal])
    assert found["device_factory"][1] == {"all_reduce": 1}  # the collective went through the rules
    assert "funcol.all_reduce" in found["functional_on_host"][1]


# ---------------------------------------------------------------- the three adapters under the rules


class Net(nn.Module):
    """An embedding, two MLP blocks (the units) and a head: every unit has linears to compress."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 192), nn.GELU(), nn.Linear(192, 64)) for _ in range(2))
        self.head = nn.Linear(64, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _wrap(model: nn.Module, wrapper: str, world: int) -> nn.Module:
    if wrapper == "simple":
        from fsdp_integration import simple_fsdp

        return simple_fsdp(model)
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, device_id=torch.device("cpu"))
    return FSDP(model, device_id=torch.device("cpu"))


def steps_under_the_rules(rank, world, wrapper, codec, recommended=False):
    torch.manual_seed(0)
    rules = NcclRules()
    with rules:
        model = _wrap(Net(), wrapper, world)  # the wrapper's own checks and collectives, under the rules
        select = "all" if wrapper == "fsdp1" else "non_attention_linear"  # FSDP1: whole units
        settings = dict(dense_steps=0, min_compress_numel=1024, codec=codec, select=select)
        hook = tagc.hook(**(settings if recommended else paper(**settings)))  # tagc: the paper's wire, or tagc.hook()'s
        tagc.register_comm_hook(model, hook)
        hook.strict_sync = True
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(100 + rank)
        reads, compressed = [], []
        for step in range(STEPS):
            tokens = torch.randint(0, 256, (4, 16), device=model.emb.weight.device if wrapper != "fsdp1" else None)
            with rules.exchange() if step else rules.paused():  # the first step plans (host work by design)
                model(tokens).square().mean().backward()
            with rules.paused():
                opt.step()
                opt.zero_grad()
                hook.end_step()
                last = hook.stats()["last_step"]
                reads.append(last["host_reads"])
                compressed.append(last["compressed_buckets"])
    return rules.violations, dict(rules.collectives), reads, compressed, dict(hook.host_read_sites)


def _check_adapter(wrapper, codec="tagc", recommended=False):
    results = run_ranks(steps_under_the_rules, 2, wrapper, codec, recommended, timeout_s=180)
    for violations, collectives, reads, compressed, sites in results:
        assert violations == [], "\n".join(violations)
        assert collectives.get("all_to_all_single", 0) > 0, collectives  # the exchange went through the rules
        assert reads[1:] == [0] * (STEPS - 1), (reads, sites)  # strict sync mode: the steady steps read nothing
        assert all(compressed), compressed
        yield collectives


def test_simple_fsdp_exchange_keeps_nccls_rules():
    for collectives in _check_adapter("simple"):
        assert collectives.get("all_reduce", 0) >= 2  # SimpleFSDP's weight check ran under the rules
        assert collectives.get("reduce_scatter_single", 0) > 0  # plain columns: NCCL's reduce-scatter


def test_fsdp2_exchange_keeps_nccls_rules():
    for collectives in _check_adapter("fsdp2"):
        assert collectives.get("reduce_scatter_single", 0) > 0


def test_fsdp1_exchange_keeps_nccls_rules():
    list(_check_adapter("fsdp1"))


def test_fsdp2_exchange_on_the_recommended_setting_keeps_nccls_rules():
    """``tagc.hook()``'s own setting for codec tagc (EF21, coded positions, float16 cells, int4 plain columns, which
    go by the all-to-all instead of NCCL's reduce-scatter) keeps the rules too."""
    for collectives in _check_adapter("fsdp2", recommended=True):
        assert collectives.get("reduce_scatter_single", 0) == 0  # int4 plain columns: no fp32 reduce-scatter
