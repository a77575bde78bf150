"""``tagc.ddp_hook``: every codec of the engine as a DDP comm hook, on 2 gloo ranks."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tagc
from tagc.hooks.adapters.ddp import DDPHookState, ring
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE, paper

pytestmark = pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 48))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 64, generator=generator), torch.randn(16, 48, generator=generator)


def _grads(ddp: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    ddp.zero_grad(set_to_none=True)
    x, y = _batch(rank, step)
    nn.functional.mse_loss(ddp(x), y).backward()
    return [p.grad.detach().clone() for p in ddp.parameters()]


def _ddp(module: nn.Module) -> DDP:
    return DDP(module, bucket_cap_mb=0.03)  # several buckets: 30 kB each


# ---------------------------------------------------------------------------------------------- exactness


def _plain_vs_ddp(rank: int, world: int) -> list[bool]:
    reference, hooked = _ddp(_model()), _ddp(_model())
    tagc.register_comm_hook(hooked, tagc.hook(codec="plain", select="all"))
    return [all(torch.equal(a, b) for a, b in zip(_grads(reference, rank, step), _grads(hooked, rank, step)))
            for step in range(3)]


@pytest.mark.parametrize("world", [2, 3])
def test_plain_is_bit_identical_to_ddp(world):
    """codec="plain": DDP's own scaling by 1/N before its all-reduce, so the gradients are DDP's bit for bit (3 ranks:
    a division by 3, before or after the sum, differs from the scaling in the last bit: the order is checked too)."""
    for result in run_ranks(_plain_vs_ddp, world):
        assert result == [True, True, True]


def _local_grads(module: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    local = copy.deepcopy(module)
    local.zero_grad(set_to_none=True)
    x, y = _batch(rank, step)
    nn.functional.mse_loss(local(x), y).backward()
    return [p.grad.detach().clone() for p in local.parameters()]


def _residual_per_parameter(state: DDPHookState) -> dict[str, torch.Tensor]:
    """This rank's error-feedback residuals, mapped from each bucket form's keys back to parameters."""
    hook, world = state.hook, dist.get_world_size()
    out = {name: torch.zeros(p.numel()) for name, p in state._ddp.module.named_parameters()}
    for layout in state._buckets.values():
        flat = torch.zeros(layout.numel + 1)
        if layout.form == "sketch":
            plan = hook.plan(layout.segments, layout.numel, world)
            for part in plan.parts:
                if part.codec is hook.plain:
                    continue
                if hook.codec.name == "powersgd":
                    for segment in layout.segments:
                        residual = hook.codec.residuals.get(f"{part.key}/{segment.name}")
                        if residual is not None:
                            flat[segment.start : segment.start + segment.numel] += residual.reshape(-1).float()
                else:
                    flat[: layout.numel][part.columns] += hook.codec.residuals[part.key][0].float()
        else:
            pieces = state._pieces(layout, world, torch.device("cpu"))
            plan = hook.plan(pieces.segments, pieces.index.shape[1], world)
            for part in plan.parts:
                residual = getattr(part.codec, "residuals", {}).get(part.key)
                if part.codec is not hook.plain and residual is not None:
                    flat.index_add_(0, pieces.index[:, part.columns].reshape(-1), residual.reshape(-1).float())
        for segment in layout.segments:
            out[segment.name] = flat[segment.start : segment.start + segment.numel].clone()
    return out


CODECS = {
    "tagc": {"ratio": 4},
    "tagc-coded": {"codec": "tagc", "ratio": 4, "positions": "coded"},
    "topk": {"codec": "topk", "ratio": 4},
    "sign": {"codec": "sign"},
    "powersgd": {"codec": "powersgd", "rank": 2},
    "bf16": {"codec": "bf16"},
    "fp8": {"codec": "fp8"},
    "int4": {"codec": "int4"},
}


def _every_codec(rank: int, world: int) -> dict:
    results = {}
    for label, settings in CODECS.items():
        model = _model()
        ddp = _ddp(copy.deepcopy(model))
        state, hook_fn = tagc.ddp_hook(ddp, **paper(select="all", dense_steps=0, min_compress_numel=1, **settings))
        ddp.register_comm_hook(state, hook_fn)
        names = [name for name, _ in model.named_parameters()]
        steps, wire = [], []
        before = {name: torch.zeros(p.numel()) for name, p in model.named_parameters()}
        for step in range(3):  # the first on DDP's first buckets, reduced as DDP does; two compressed
            local = _local_grads(model, rank, step)
            got = _grads(ddp, rank, step)
            state.end_step()
            wire.append(state.stats()["last_step"]["wire_bytes"])
            after = _residual_per_parameter(state)
            records = []
            for name, g, avg in zip(names, local, got):
                gathered = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(gathered, g)
                res_after = [torch.empty_like(after[name]) for _ in range(world)]
                dist.all_gather(res_after, after[name])
                res_before = [torch.empty_like(before[name]) for _ in range(world)]
                dist.all_gather(res_before, before[name])
                records.append({"name": name, "grads": torch.stack(gathered).double(), "avg": avg.double(),
                                    "res_before": torch.stack(res_before).double(),
                                    "res_after": torch.stack(res_after).double()})
            before = after
            steps.append(records)
        results[label] = {"steps": steps, "stats": state.stats()["last_step"], "forms": state.forms(), "wire": wire,
                          "numel": sum(p.numel() for p in model.parameters()), "counted": state.stats()["step"]}
    return results


@pytest.fixture(scope="module")
def every_codec():
    return run_ranks(_every_codec, 2, timeout_s=240.0)


def test_ranks_agree(every_codec):
    """DDP replicas must stay identical: every form gives both ranks the same bits."""
    for label in CODECS:
        for step0, step1 in zip(every_codec[0][label]["steps"], every_codec[1][label]["steps"]):
            for a, b in zip(step0, step1):
                assert torch.equal(a["avg"], b["avg"]), (label, a["name"])


@pytest.mark.parametrize("label", ["tagc", "tagc-coded", "topk", "sign", "powersgd"])
def test_error_feedback_conserves_mass(every_codec, label):
    """What the ranks sent (N times the average) plus what they kept equals what they produced: sum of grads
    plus the residuals they started from, to float32 rounding of the magnitudes involved."""
    result = every_codec[0][label]
    sent_something = False
    for step, records in enumerate(result["steps"]):
        for r in records:
            world = r["grads"].shape[0]
            produced = r["grads"].reshape(world, -1).sum(0) + r["res_before"].sum(0)
            accounted = world * r["avg"].reshape(-1) + r["res_after"].sum(0)
            scale = (r["grads"].abs().reshape(world, -1).sum(0) + r["res_before"].abs().sum(0)
                     + r["res_after"].abs().sum(0))
            assert ((accounted - produced).abs() <= 1e-5 * scale + 1e-30).all(), (label, r["name"])
            sent_something |= bool((r["avg"] != 0).any())
            if step and label != "powersgd":  # compressed steps: not everything went, the residual holds the rest
                assert r["res_after"].abs().sum() > 0 or r["grads"].abs().sum() == 0
    assert sent_something


def test_tagc_all_reduce_form(every_codec):
    """TAGC takes the all-reduce form (the summed sketch, the OR-ed index), peels everything, sends elements,
    and the bytes on the wire are the planned ones."""
    result = every_codec[0]["tagc"]
    stats = result["stats"]
    assert stats["peel_success"] == 1.0 and stats["support"] > 0 and stats["nonfinite_parts"] == 0
    forms = result["forms"]
    assert {form for form, _ in forms.values()} == {"sketch"}
    planned = sum(bytes_[form] for form, bytes_ in forms.values())
    assert stats["wire_bytes"] == planned  # the last step: every bucket compressed
    for form, bytes_ in forms.values():  # the chosen form is the leanest of those planned
        assert bytes_[form] == min(bytes_.values())


def test_ddps_first_iteration_is_its_own_uncounted_step(every_codec):
    """DDP's first iteration, reduced as DDP does, closes its own statistics (an fp32 ring all-reduce of every
    parameter) and is not counted; the next step holds only its own compressed bytes."""
    result = every_codec[0]["tagc"]
    planned = sum(bytes_[form] for form, bytes_ in result["forms"].values())
    assert result["wire"] == [ring(4 * result["numel"], 2), planned, planned] and result["counted"] == 2


def test_reduce_scatter_forms_are_taken_where_leaner(every_codec):
    """Coded positions cannot be added in an all-reduce: they go by a reduce-scatter form, as do the peers."""
    for label in ("tagc-coded", "topk", "sign", "int4"):
        forms = every_codec[0][label]["forms"]
        assert all(form in ("rs+ag", "gather") and bytes_[form] == min(bytes_.values())
                   for form, bytes_ in forms.values()), (label, forms)


@pytest.mark.parametrize("label,bound", [("bf16", "relative"), ("fp8", 2.0**-4), ("int4", 1 / 14)])
def test_quantized_bounds(every_codec, label, bound):
    """bf16 within 2^-8 of each value, and 2^-8 of the average again where the reduced pieces are gathered in bf16
    (``rs+ag``: :func:`tagc.hooks.adapters.replicas.replica_gather_dtype`); fp8 / int4 within 2^-4 / 1/14 of the
    block's largest magnitude (bounded here by the rank's largest), against the exact average."""
    forms = {form for form, _ in every_codec[0][label]["forms"].values()}
    regathered = forms == {"rs+ag"} and label == "bf16"  # 2 ranks: its bf16 gather ties the wires' gather in bytes
    assert len(forms) == 1 and (regathered or label != "bf16"), forms
    for records in every_codec[0][label]["steps"][1:]:  # the compressed steps
        largest = torch.stack([r["grads"].reshape(r["grads"].shape[0], -1).abs().amax(1) for r in records]).amax(0)
        for r in records:
            grads = r["grads"]
            exact = grads.mean(0)
            error = (r["avg"] - exact).abs()
            if bound == "relative":
                limit = 2.0**-8 * (grads.abs().mean(0) + regathered * exact.abs()) + 1e-12
            else:
                limit = bound * largest.mean() + 1e-12  # each rank's error within bound x its largest magnitude
            assert (error <= limit).all(), (label, r["name"], float((error - limit).max()))
            assert (error > 0).any() or label == "bf16"  # the codec really quantized (no plain fallback)


# ---------------------------------------------------------------------------------------------- the peer


def _powersgd_vs_torch(rank: int, world: int, r: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    torch.manual_seed(0)
    module = nn.Linear(32, 48)
    ours, theirs = DDP(copy.deepcopy(module)), DDP(copy.deepcopy(module))
    # torch's start_powerSGD_iter counts DDP's first iteration, which our hook reduces as DDP does and does not count
    ours.register_comm_hook(*tagc.ddp_hook(ours, codec="powersgd", rank=r, select="all", dense_steps=1,
                                           min_compress_numel=1))
    state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2)
    theirs.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    sent = {"ours": [], "theirs": []}
    real_all_reduce = dist.all_reduce
    out = []
    for step in range(4):
        generator = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(1, 32, generator=generator)  # one sample per rank: the summed weight gradient has rank <= 2
        y = torch.randn(1, 48, generator=generator)
        row = {}
        for label, model in (("ours", ours), ("theirs", theirs)):
            def counting(tensor, *args, _label=label, _step=step, **kwargs):
                if _step >= 2:
                    sent[_label].append(tensor.numel() * tensor.element_size())
                return real_all_reduce(tensor, *args, **kwargs)

            dist.all_reduce = counting
            try:
                model.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
            finally:
                dist.all_reduce = real_all_reduce
            row[label] = [p.grad.clone() for p in model.parameters()]
        exact = []
        for p in module.parameters():
            p.grad = None
        nn.functional.mse_loss(module(x), y).backward()
        for p in module.parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            exact.append(g / world)
        row["exact"] = exact
        out.append(row)
    return {"steps": out, "sent": sent}


def test_powersgd_matches_torch_powersgd_hook():
    """Our powersgd and torch's powerSGD_hook at rank 2 on a gradient of rank 2: both reconstruct the exact
    average to float32 rounding (so agree with each other), and all-reduce the same bytes (P, Q, the bias)."""
    result = run_ranks(_powersgd_vs_torch, 2, 2)[0]
    for step, row in enumerate(result["steps"]):
        for ours, theirs, exact in zip(row["ours"], row["theirs"], row["exact"]):
            scale = exact.abs().max()
            assert (ours - exact).abs().max() <= 1e-5 * scale, step
            assert (theirs - exact).abs().max() <= 1e-5 * scale, step
            assert (ours - theirs).abs().max() <= 1e-5 * scale, step
    # steps 2 and 3 compressed: torch all-reduces the bias, P (48 x 2) and Q (32 x 2); we P with the bias, then Q
    assert sum(result["sent"]["ours"]) == sum(result["sent"]["theirs"]) == 2 * 4 * (48 + 48 * 2 + 32 * 2)


# ---------------------------------------------------------------------------------------------- settings


def _mismatch(rank: int, world: int) -> str:
    ddp = _ddp(_model())
    tagc.register_comm_hook(ddp, tagc.hook(ratio=8 if rank else 10, select="all", dense_steps=0, min_compress_numel=1))
    try:
        _grads(ddp, rank, 0)
    except Exception as error:  # noqa: BLE001 - DDP may wrap it; the message is what matters
        return str(error)
    return ""


def test_mismatched_settings_raise_on_every_rank():
    for message in run_ranks(_mismatch, 2):
        assert "settings differ across ranks" in message and "ratio" in message


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="codec must be one of"):
        tagc.ddp_hook(model, codec="nope")
    with pytest.raises(ValueError, match="apply only to codecs|applies only to codecs"):
        tagc.ddp_hook(model, ratio=10, codec="bf16")
    with pytest.raises(TypeError, match="DDP model"):
        tagc.ddp_hook("model", ratio=10)
    with pytest.raises(TypeError, match="tagc.hook"):
        DDPHookState(object(), model)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        tagc.ddp_hook(model, ratio=10)  # the module, not its DDP wrapper


def test_ring_bytes():
    assert ring(1000, 2) == 1000 and ring(1000, 4) == 1500 and ring(1000, 1) == 0


# ---------------------------------------------------------------------------------------------- checkpoints


def _hooked(settings: dict) -> tuple[DDP, DDPHookState]:
    ddp = _ddp(_model())
    state, hook_fn = tagc.ddp_hook(ddp, **settings)
    ddp.register_comm_hook(state, hook_fn)
    return ddp, state


def _checkpoint(rank: int, world: int) -> list[bool]:
    settings = {"ratio": 4, "select": "all", "dense_steps": 1, "min_compress_numel": 1, **PAPER_WIRE}
    original, state = _hooked(settings)
    for step in range(4):  # DDP's first buckets, one dense step, two compressed
        _grads(original, rank, step)
        state.end_step()
    saved = state.state_dict()
    restored, restored_state = _hooked(settings)  # a new process: a new DDP model
    restored_state.load_state_dict(saved)
    fresh, fresh_state = _hooked(settings)  # the same, without the residuals
    fresh_state.load_state_dict({key: value for key, value in saved.items() if not key.startswith("residual.")})
    for model, hook_state in ((restored, restored_state), (fresh, fresh_state)):  # DDP's first buckets
        _grads(model, rank, 99)
        hook_state.end_step()
    checks = [any(key.startswith("residual.") for key in saved)]
    for step in range(4, 6):
        a, b, c = _grads(original, rank, step), _grads(restored, rank, step), _grads(fresh, rank, step)
        for s in (state, restored_state, fresh_state):
            s.end_step()
        checks.append(all(torch.equal(x, y) for x, y in zip(a, b)))
        checks.append(not all(torch.equal(x, z) for x, z in zip(a, c)))  # the residuals matter
    return checks


def test_checkpoint_round_trip():
    """The restored hook continues bit for bit as the original; a hook without the residuals does not."""
    for result in run_ranks(_checkpoint, 2):
        assert all(result), result


# ---------------------------------------------------------------------------------------------- the overlap

OVERLAP_CODECS = {
    "plain": {"codec": "plain"},
    "tagc": {"ratio": 4},
    "tagc-4bit": {"ratio": 4, "index_bits": 4},
    "topk": {"codec": "topk", "ratio": 4},
    "int4": {"codec": "int4"},
    "powersgd": {"codec": "powersgd", "rank": 2},
    "bf16": {"codec": "bf16"},
    "tagc-raw": {"ratio": 4, "fallback": "raw"},
    "powersgd-bf16": {"codec": "powersgd", "rank": 2, "value_dtype": "bfloat16"},
    "powersgd-lean": {"codec": "powersgd", "rank": 2, "value_dtype": "bfloat16", "plain": "bf16"},
    "powersgd-rs+ag": {"codec": "powersgd", "rank": 2, "plain": "fp8"},
    "powersgd-4-buckets": {"codec": "powersgd", "rank": 2, "deep": True},
    "powersgd-lean-4-buckets": {"codec": "powersgd", "rank": 2, "value_dtype": "bfloat16", "plain": "bf16",
                                "deep": True},
    "tagc-bf16-warmup": {"ratio": 4, "plain": "bf16", "dense_steps": 1},
    "tagc-raw-4-buckets": {"ratio": 4, "fallback": "raw", "deep": True},
}
"""Every form: ``allreduce`` (plain), ``sketch`` (tagc: OR-ed and summed indexes; powersgd: P then Q, in fp32, bf16
values beside fp32 plain parts, all bf16), ``gather`` (topk, int4) and ``rs+ag`` (coded raw re-sends,
powersgd's four rounds with fp8 plain columns, which cannot go by an all-reduce, a bf16 dense warm-up, the bf16
codec, whose bf16 all-gather ties the gathered wires' bytes on 2 ranks), on 2
buckets (``_ddp``) or, ``deep``, 4 (:func:`_deep_ddp`: PowerSGD's ``Q`` and ``rs+ag``'s all-gather, with raw re-sends
inside the reduce-scatter's finish, launched at the next bucket's hook call)."""


def _deep_ddp() -> DDP:
    """Four linear layers (64 -> 64 -> 64 -> 64 -> 48) in four buckets of a weight and its bias."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
              nn.Linear(64, 48)]
    return DDP(nn.Sequential(*layers), bucket_cap_mb=0.005)

COUNTERS = ("buckets", "compressed_buckets", "wire_bytes", "plain_equivalent_bytes", "inter_host_bytes", "support",
            "peeled", "unpeeled", "estimated", "raw", "overflow", "bitmap_blocks", "nonfinite_parts")


def _overlapped_vs_blocking(rank: int, world: int) -> dict:
    results = {}
    for label, settings in OVERLAP_CODECS.items():
        settings = paper(**{"select": "all", "dense_steps": 0, "min_compress_numel": 1, **settings})
        deep = settings.pop("deep", False)
        runs = []
        for overlap in (True, False):
            ddp = _deep_ddp() if deep else _ddp(_model())
            state, hook_fn = tagc.ddp_hook(ddp, overlap=overlap, **settings)
            ddp.register_comm_hook(state, hook_fn)
            steps = []
            for step in range(4):  # DDP's first buckets, then three reduced by the hook (error feedback carried)
                steps.append(_grads(ddp, rank, step))
                state.end_step()
            total = state.stats()["total"]
            runs.append({"steps": steps, "forms": state.forms(), "counters": {k: total[k] for k in COUNTERS},
                         "finished_in_backward": state.flights.drained_task != -1,
                         "residuals": {k: v.clone() for k, v in state.state_dict().items()
                                       if k.startswith("residual.") and isinstance(v, torch.Tensor)}})
        results[label] = runs
    return results


def test_overlapped_hook_gives_the_blocking_hooks_gradients_bit_for_bit():
    """Every codec, in every form: the overlapped hook (collectives launched async, decoded in their callbacks, the
    dependent ones launched at the next bucket's hook call or at the end of the backward pass) gives the gradients,
    residuals and byte counts of the blocking one (overlap=False), bit for bit, step after step; every compressing
    form was deferred."""
    forms = set()
    for rank_result in run_ranks(_overlapped_vs_blocking, 2, timeout_s=300.0):
        for label, (overlapped, blocking) in rank_result.items():
            for step, (a, b) in enumerate(zip(overlapped["steps"], blocking["steps"])):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (label, step)
                assert any(x.abs().sum() > 0 for x in a), (label, step)
            assert overlapped["forms"] == blocking["forms"], label
            assert overlapped["counters"] == blocking["counters"], label
            assert overlapped["residuals"].keys() == blocking["residuals"].keys(), label
            assert all(torch.equal(v, blocking["residuals"][k]) for k, v in overlapped["residuals"].items()), label
            assert overlapped["finished_in_backward"] == (label != "plain"), label  # plain: DDP's own all-reduce
            assert not blocking["finished_in_backward"], label
            forms |= {form for form, _ in overlapped["forms"].values()}
            buckets = 4 if label.endswith("4-buckets") else 0 if label == "plain" else 2  # plain: DDP's all-reduce
            assert len(overlapped["forms"]) == buckets, label
            expected = {"powersgd-lean": "sketch", "powersgd-rs+ag": "rs+ag", "powersgd-4-buckets": "sketch",
                        "powersgd-lean-4-buckets": "sketch", "tagc-raw-4-buckets": "rs+ag"}.get(label)
            assert expected is None or {form for form, _ in overlapped["forms"].values()} == {expected}, label
    assert forms == {"sketch", "gather", "rs+ag"}


LAUNCH_ORDER_CODECS = {
    "powersgd": {"codec": "powersgd", "rank": 2},
    "powersgd-lean": {"codec": "powersgd", "rank": 2, "value_dtype": "bfloat16", "plain": "bf16"},
    "rs+ag": {"ratio": 4, "fallback": "raw"},
}


def _launch_order(rank: int, world: int) -> dict:
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # torch 2.11's
    real = {"all_reduce": dist.all_reduce, "all_gather_single": getattr(dist, gather)}
    events = []

    def recording(name):
        def collective(tensor, *args, **kwargs):
            events.append((name, tensor.numel()))
            return real[name](*((tensor,) + args), **kwargs)

        return collective

    out = {}
    try:
        dist.all_reduce = recording("all_reduce")
        setattr(dist, gather, recording("all_gather_single"))
        for label, settings in LAUNCH_ORDER_CODECS.items():
            for overlap in (True, False):
                ddp = _deep_ddp()
                state, hook_fn = tagc.ddp_hook(ddp, overlap=overlap, **paper(select="all", dense_steps=0,
                                                                             min_compress_numel=1, **settings))

                def called(hook_state, bucket, _hook=hook_fn):
                    events.append(("call", tuple(tuple(p.shape) for p in bucket.parameters())))
                    return _hook(hook_state, bucket)

                ddp.register_comm_hook(state, called)
                for step in range(3):  # DDP's first buckets, then two compressed steps: the last one is recorded
                    events.clear()
                    _grads(ddp, rank, step)
                    state.end_step()
                out[label, overlap] = {"events": list(events), "forms": {f for f, _ in state.forms().values()}}
    finally:
        dist.all_reduce = real["all_reduce"]
        setattr(dist, gather, real["all_gather_single"])
    return out


def test_dependent_collectives_go_at_the_next_buckets_hook_call():
    """Four buckets. Overlapped, bucket k's second collective (PowerSGD's ``Q`` all-reduce; ``rs+ag``'s all-gather)
    is launched at bucket k+1's hook call, before that bucket's first collective, so bucket 0's goes while the
    backward still has buckets 2 and 3 to compute; only the last bucket's waits for the end of the backward pass.
    The collectives come in the blocking hook's order (which launches both inside the bucket's own call), so every
    rank launches them in one order. Shapes: ``P`` = rows x 2 with the bias, ``Q`` = cols x 2."""
    for result in run_ranks(_launch_order, 2, timeout_s=240.0):
        for label in ("powersgd", "powersgd-lean"):
            for overlap in (True, False):
                run = result[label, overlap]
                assert run["forms"] == {"sketch"}, label
                calls = [e for e in run["events"] if e[0] == "call"]
                assert len(calls) == 4, label
                first = [("all_reduce", shapes[1][0] * 2 + shapes[0][0]) for _, shapes in calls]  # bias, weight
                second = [("all_reduce", shapes[1][1] * 2) for _, shapes in calls]
                if overlap:
                    expected = [calls[0], first[0]]
                    for k in range(1, 4):
                        expected += [calls[k], second[k - 1], first[k]]
                    expected.append(second[3])
                else:
                    expected = [e for k in range(4) for e in (calls[k], first[k], second[k])]
                assert run["events"] == expected, (label, overlap)
        for overlap in (True, False):
            run = result["rs+ag", overlap]
            assert run["forms"] == {"rs+ag"}
            seen = [e[0] for e in run["events"] if e[0] in ("call", "all_gather_single")]
            if overlap:
                assert seen == ["call", "call", "all_gather_single", "call", "all_gather_single", "call",
                                "all_gather_single", "all_gather_single"], seen
            else:
                assert seen == ["call", "all_gather_single"] * 4, seen


DELAY_S = 0.3
"""Every all-reduce of the timed step completes this long after its launch (a slow link)."""
COMPUTE_S = 0.1
"""Each layer's backward is made this long, so there is compute to hide the exchanges behind."""


class _SlowWork:
    """An async all-reduce whose future completes ``DELAY_S`` after launch, with the real one's value."""

    def __init__(self, work) -> None:
        launched = time.perf_counter()
        self.future = torch.futures.Future()

        def arrived(done: torch.futures.Future) -> None:
            def complete() -> None:
                try:
                    self.future.set_result(done.value())
                except Exception as error:  # noqa: BLE001 - handed on to the waiter
                    self.future.set_exception(error)

            threading.Timer(max(0.0, launched + DELAY_S - time.perf_counter()), complete).start()

        work.get_future().add_done_callback(arrived)

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> bool:
        self.future.wait()
        return True


def _slow_link(rank: int, world: int) -> dict:
    real_all_reduce = dist.all_reduce
    slow = {"on": False}

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        work = real_all_reduce(tensor, *args, async_op=async_op, **kwargs)
        return _SlowWork(work) if async_op and slow["on"] else work

    def slow_backward(module: nn.Module, args, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: time.sleep(COMPUTE_S) if slow["on"] else None)

    dist.all_reduce = all_reduce
    out = {}
    try:
        for overlap in (True, False):
            torch.manual_seed(0)
            layers = [nn.Linear(128, 128) for _ in range(4)]
            for layer in layers:  # each layer's backward takes COMPUTE_S (when its output's gradient arrives)
                layer.register_forward_hook(slow_backward)
            ddp = DDP(nn.Sequential(*layers), bucket_cap_mb=0.05)  # a bucket per layer's weight
            state, hook_fn = tagc.ddp_hook(ddp, ratio=4, select="all", dense_steps=0, min_compress_numel=1,
                                           overlap=overlap, **PAPER_WIRE)
            events = []

            def timed(hook_state, bucket, _events=events, _hook=hook_fn):
                index = bucket.index()
                _events.append(("call", index, time.perf_counter()))

                def arrived(future: torch.futures.Future, at: int = index) -> torch.Tensor:
                    _events.append(("done", at, time.perf_counter()))
                    return future.value()

                return _hook(hook_state, bucket).then(arrived)  # DDP waits for the time to be taken

            ddp.register_comm_hook(state, timed)
            x = torch.randn(8, 128, generator=torch.Generator().manual_seed(rank))
            for step in range(3):  # the last is timed: DDP's first buckets, the plans and kernels are made before
                slow["on"] = step == 2
                events.clear()
                loss = ddp(x).square().sum()
                start = time.perf_counter()
                loss.backward()
                backward_s = time.perf_counter() - start
                state.end_step()
            calls = {i: t for kind, i, t in events if kind == "call"}
            done = {i: t for kind, i, t in events if kind == "done"}
            out[overlap] = {"backward_s": backward_s, "calls": calls, "done": done,
                            "forms": {form for form, _ in state.forms().values()}}
    finally:
        dist.all_reduce = real_all_reduce
    return out


@pytest.mark.slow
def test_the_exchanges_overlap_the_backward_pass():
    """With a slow link (every all-reduce DELAY_S) and a slow backward (COMPUTE_S per layer), the overlapped hook
    lets the backward go on while earlier buckets are on the wire: the next bucket is handed over before the first
    one's exchange completes, and the step takes at least a delay less than blocking, which pays one per bucket."""
    for result in run_ranks(_slow_link, 2, timeout_s=180.0):
        overlapped, blocking = result[True], result[False]
        buckets = len(blocking["calls"])
        assert buckets >= 3 and len(overlapped["calls"]) == buckets
        assert overlapped["forms"] == blocking["forms"] == {"sketch"}
        assert all(run["done"][i] > run["calls"][i] for run in (overlapped, blocking) for i in run["calls"])
        assert blocking["backward_s"] >= buckets * DELAY_S + 4 * COMPUTE_S
        assert overlapped["backward_s"] < blocking["backward_s"] - DELAY_S
        first, second = sorted(overlapped["calls"])[:2]  # DDP hands the buckets over in index order
        assert overlapped["calls"][second] < overlapped["done"][first]  # backward went on while bucket 0 flew
        assert blocking["done"][first] <= blocking["calls"][second]  # blocking: it waited


def _raising(rank: int, world: int) -> dict:
    out = {}
    for label, settings in {"tagc": {"ratio": 4}, "int4": {"codec": "int4"}}.items():
        for overlap in (True, False):
            ddp = _ddp(_model())
            state, hook_fn = tagc.ddp_hook(ddp, overlap=overlap, **paper(select="all", dense_steps=0,
                                                                         min_compress_numel=1, nonfinite="raise",
                                                                         **settings))
            ddp.register_comm_hook(state, hook_fn)
            _grads(ddp, rank, 0)  # DDP's first buckets
            x, y = _batch(rank, 1)
            try:
                (nn.functional.mse_loss(ddp(x), y) * (float("nan") if rank else 1.0)).backward()
                out[label, overlap] = None
            except FloatingPointError as error:
                out[label, overlap] = str(error)
    return out


@pytest.mark.slow
def test_nonfinite_raise_is_raised_by_the_backward_pass_overlapped_or_not():
    """nonfinite="raise" in the sketch (tagc: checked once its callback decoded) and gather (int4: raised in the
    callback) forms: the backward pass raises FloatingPointError on every rank, overlapped as blocking, naming the
    bucket (no hang, no wrapping)."""
    for result in run_ranks(_raising, 2, timeout_s=120.0):
        for label in ("tagc", "int4"):
            assert result[label, True] is not None and "NaN/Inf" in result[label, True], label
            assert result[label, True] == result[label, False], label


@pytest.mark.parametrize("hosts", [2, 3])
def test_pieces_cut_a_shard_into_each_parameters_pieces_and_join_it_back(hosts):
    from tagc.hooks.adapters.replicas import Pieces
    from tagc.hooks.core.segment import Segment

    sizes = (7, 1, 12, 5)  # none but 12 divides by 2 or 3: every other parameter is padded
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = Pieces.build(tuple(Segment(f"p{i}", s, n) for i, (s, n) in enumerate(zip(starts, sizes))),
                          sum(sizes), hosts, torch.device("cpu"))
    shard = torch.randn(sum(sizes))
    rows = pieces.cut(shard)
    at = 0
    for start, n in zip(starts, sizes):  # row h: the h-th of each parameter's equal pieces, zero-padded, in order
        per = -(-n // hosts)
        assert torch.equal(rows[:, at:at + per], torch.cat([shard[start:start + n], torch.zeros(hosts * per - n)])
                           .view(hosts, per))
        at += per
    assert rows.shape == (hosts, at)
    assert torch.equal(pieces.join(rows), shard)
    assert torch.equal(pieces.join(rows * 2), shard * 2)
    numel = sum(sizes)
    for into in (torch.empty(numel), torch.empty(numel, dtype=torch.float64), torch.empty(2 * numel)[::2]):
        assert pieces.join(rows, into=into) is into and torch.equal(into, shard.to(into.dtype))
