"""Public options of ``tagc.hook`` that no other test reaches: ``residual_dtype`` through the hook and
its checkpoints, ``load_state_dict`` refusing a checkpoint of other settings, ``fallback="error"``
on every rank, and NaN/Inf under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.config import TAGCConfig
from tagc.hooks import Segment
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE, paper

N = 200_000
SEGMENTS = [Segment("w", 0, N)]


def _exchange(hook, grad: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = torch.empty(grad.shape[1])
    hook.reduce_scatter(out, grad.reshape(-1).clone(), None, op, SEGMENTS)
    return out


def _gathered(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    everyone = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(everyone, tensor)
    return everyone


# ----------------------------------------------------------------------------- residual_dtype


def _bf16_residuals(rank, world):
    """Two steps of a bf16-residual hook; then its checkpoint resumed into a new hook."""
    options = {"dense_steps": 0, "ratio": 10, "select": "all", "residual_dtype": torch.bfloat16,
               "min_compress_numel": 1024, **PAPER_WIRE}  # classic error feedback: a bf16 residual is its own
    hook = tagc.hook(**options)
    gen = torch.Generator().manual_seed(rank)
    held = torch.zeros(world, N, dtype=torch.bfloat16)
    steps = []
    for _ in range(2):
        grad = torch.randn(world, N, generator=gen)
        out = _exchange(hook, grad)
        ((residual,),) = hook.residuals.values()  # one bucket, one part
        accumulated = (held.float() + grad).bfloat16()  # error feedback adds in the residual's dtype
        kept = residual == 0
        sent = torch.where(kept, accumulated, torch.zeros((), dtype=torch.bfloat16)).float()
        expected = sum(s[rank] for s in _gathered(sent, world))
        steps.append({"dtype": residual.dtype, "held": int((~kept).sum()),
                      "held_is_accumulated": bool(torch.equal(residual[~kept], accumulated[~kept])),
                      "error": ((out - expected).norm() / expected.norm()).item()})
        held = residual.clone()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in hook.state_dict().items()}
    resumed = tagc.hook(**options)
    resumed.load_state_dict(state)
    grad = torch.randn(world, N, generator=gen)
    same = torch.equal(_exchange(resumed, grad), _exchange(hook, grad))
    loaded = [part.dtype for parts in resumed.residuals.values() for part in parts]
    return steps, {k: v.dtype for k, v in state.items() if k.startswith("residual.")}, same, loaded


@pytest.mark.filterwarnings("ignore:TAGC. the CPU kernels take contiguous float32 residuals")
def test_bf16_residuals_through_the_hook_and_its_checkpoint():
    for steps, saved, resumes, loaded in run_ranks(_bf16_residuals, 2):
        for step in steps:
            assert step["dtype"] == torch.bfloat16
            assert step["held_is_accumulated"]  # what is held back is the bf16 sum of residual and gradient
            assert step["held"] >= 0.9 * 2 * N  # most of it is held back (about 3.6% sent per row at N = 2)
            assert step["error"] <= 1e-6  # the owner decodes the sum of what the ranks sent
        assert list(saved.values()) == [torch.bfloat16]  # the checkpoint keeps bf16 (half the bytes)
        assert resumes and loaded == [torch.bfloat16]  # and resumes to the identical next step


def test_residual_dtype_other_than_float32_or_bfloat16_is_refused():
    with pytest.raises(ValueError, match="residual_dtype must be torch.float32 or torch.bfloat16"):
        tagc.hook(dense_steps=0, residual_dtype=torch.float16)


# ----------------------------------------------------------------------------- load_state_dict refuses other settings


def _checkpoint(**options) -> dict:
    """A one-process hook's state after one step (no process group: world 1 sends plain, so set a residual)."""
    hook = tagc.hook(**paper(dense_steps=0, **options))  # the paper's codec: its residuals are classic ones
    state = hook.state_dict()
    state["residual.rank0.w#8/part0"] = torch.ones(1, 8)
    return state


@pytest.mark.parametrize("field, other", [("ratio", 5.0), ("index_bits", 4), ("sparsity", 0.9), ("lane", 256),
                                          ("seed", 1), ("fallback", "raw"), ("min_compress_numel", 1024)])
def test_load_state_dict_refuses_a_checkpoint_of_other_settings(field, other):
    assert getattr(TAGCConfig(), field) != other
    state = _checkpoint()
    hook = tagc.hook(**paper(dense_steps=0, **{field: other}))
    with pytest.raises(ValueError, match="checkpoint was written with TAGC settings") as error:
        hook.load_state_dict(state)
    assert f"{field}={other!r}" in str(error.value)  # the message shows this hook's settings
    assert hook.codec.residuals == {} and hook.step_count == 0  # nothing was loaded
    same = tagc.hook(**paper(dense_steps=0))  # the settings it was written with: loads
    same.load_state_dict(state)
    assert torch.equal(same.codec.residuals["w#8/part0"], torch.ones(1, 8))


# ----------------------------------------------------------------------------- fallback="error"


def _fallback_error(rank, world, one_owner):
    """Dense rows (sparsity 0: everything kept) are far above the peeling threshold. With ``one_owner``
    only owner 0's rows are; owner 1's are mostly exact zeros, which are never kept, so it decodes."""
    hook = tagc.hook(dense_steps=0, ratio=10, sparsity=0.0, select="all", fallback="error", min_compress_numel=1024)
    gen = torch.Generator().manual_seed(rank)
    grad = torch.randn(world, N, generator=gen)
    if one_owner:
        grad[1] *= torch.rand(N, generator=gen) < 0.01
    try:
        _exchange(hook, grad)
    except RuntimeError as error:
        message = str(error)
    else:
        message = None
    agreed = _exchange(tagc.hook(dense_steps=0, ratio=10, select="all", min_compress_numel=1024),
                       torch.randn(world, N, generator=gen))  # the group still works
    return message, bool(agreed.isfinite().all())


def test_fallback_error_raises_on_every_rank_when_every_owner_fails():
    for message, still_works in run_ranks(_fallback_error, 2, False):
        assert message is not None and "could not recover" in message and "fallback='estimate'/'raw'" in message
        assert still_works


def test_fallback_error_raises_on_every_rank_when_one_owner_fails():
    results = run_ranks(_fallback_error, 2, True)
    assert results[0][0] is not None and "could not recover" in results[0][0]  # owner 0 cannot decode
    assert results[1][0] is not None, "rank 1 returned normally while rank 0 raised"
    assert "another rank of this group" in results[1][0] and "fallback='estimate'/'raw'" in results[1][0]
    assert all(still_works for _, still_works in results)


# ----------------------------------------------------------------------------- NaN/Inf under torch.compile


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(24, 64)
        self.h = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.h:
            x = torch.relu(block(x))
        return self.out(x)


def _nonfinite_compiled(rank, world, policy):
    """Eager and compiled SimpleFSDP models, the same hook settings: a clean step, a step whose loss is NaN
    on rank 1, a clean step. Returns each model's local gradients per step (None where the step raised)."""
    from fsdp_integration import CompileSettings, compile_model, simple_fsdp

    runs = {}
    for compiled in (False, True):
        model = simple_fsdp(_Blocks())
        hook = tagc.hook(dense_steps=0, ratio=10, select="all", min_compress_numel=1024, nonfinite=policy)
        tagc.register_comm_hook(model, hook)
        forward = compile_model(model, CompileSettings(backend="aot_eager")) if compiled else model
        steps = []
        for step in range(3):
            x = torch.randn(8, 24, generator=torch.Generator().manual_seed(10 * step + rank))
            scale = float("nan") if step == 1 and rank == 1 else 1.0
            try:
                (forward(x).square().mean() * scale).backward()
                steps.append([p.grad.to_local().clone() for p in model.parameters()])
            except FloatingPointError as error:
                steps.append(str(error))
            model.zero_grad()
            hook.end_step()
        runs[compiled] = (steps, hook.stats()["total"]["nonfinite_parts"])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["propagate", "raise"])
def test_nonfinite_gradients_under_torch_compile_as_in_eager(policy):
    for runs in run_ranks(_nonfinite_compiled, 2, policy, timeout_s=300):
        (eager, eager_nonfinite), (compiled, compiled_nonfinite) = runs[False], runs[True]
        # the clean steps: the same gradients (after a NaN step that propagated: residuals were not poisoned)
        for step in (0, 2) if policy == "propagate" else (0,):
            assert all(torch.allclose(c, e, rtol=1e-5, atol=1e-6) for c, e in zip(compiled[step], eager[step]))
            assert all(g.isfinite().all() for g in compiled[step])
        if policy == "raise":  # every rank raises, compiled or not, naming the policy
            assert isinstance(eager[1], str) and isinstance(compiled[1], str) and "nonfinite='raise'" in compiled[1]
            assert all(g.isfinite().all() for g in compiled[2])
        else:  # NaN reaches every owner: each compressed part NaN as a whole, in both
            assert all(g.isnan().all() for g in eager[1]) and all(g.isnan().all() for g in compiled[1])
            assert compiled_nonfinite == eager_nonfinite > 0


@pytest.mark.xfail(strict=True, reason="after a step that raised (nonfinite='raise') the next step's gradients differ "
                   "between eager and compiled: the finite rank's residuals after the raise differ (likely eager "
                   "encodes every unit's parts before the end-of-backward drain raises, while the compiled backward "
                   "stops at the first unit's op). Keep every residual as it was on a raising step, or document it")
@pytest.mark.slow
def test_the_step_after_a_raise_is_the_same_eager_and_compiled():
    for runs in run_ranks(_nonfinite_compiled, 2, "raise", timeout_s=300):
        (eager, _), (compiled, _) = runs[False], runs[True]
        assert all(torch.allclose(c, e, rtol=1e-5, atol=1e-6) for c, e in zip(compiled[2], eager[2]))
