"""The per-step diagnostics and the library's defaults in the trainer (the seeds protocol that was here is
gpt2_bench.evidence's now: tests/test_evidence.py)."""

import json
import math

import pytest
import torch

import tagc
from gpt2_bench import compare, compare_paper, diagnostics
from gpt2_bench.config import TrainConfig, build_parser, config_from_args

# ----------------------------------------------------------------------------- defaults from the library


def test_dense_steps_default_to_the_librarys_unless_a_flag_says_otherwise():
    from tagc.hooks.core.engine import DENSE_STEPS

    assert TrainConfig().dense_steps == DENSE_STEPS  # tagc on the non-attention layers, as tagc.hook() gives
    assert (
        TrainConfig(codec="topk").dense_steps
        == TrainConfig(codec="powersgd", compression="all").dense_steps
        == DENSE_STEPS
    )
    assert TrainConfig(codec="int4", compression="all").dense_steps == 0  # no error feedback: nothing to warm up
    assert TrainConfig(compression="none").dense_steps == 0
    assert TrainConfig(dense_steps=0).dense_steps == 0
    assert config_from_args(build_parser().parse_args([])).dense_steps == DENSE_STEPS
    assert config_from_args(build_parser().parse_args(["--dense-steps", "3"])).dense_steps == 3
    with pytest.raises(ValueError, match="dense_steps"):
        TrainConfig(dense_steps=-1)


def test_the_compares_main_job_keeps_its_ten_dense_steps(monkeypatch):
    """The README's main job (``python -m gpt2_bench.compare``) ran with --dense-steps 10 set by the compare;
    the library's default gives it the same."""
    captured = {}

    def stop(base):
        captured["base"] = base
        raise SystemExit(0)

    monkeypatch.setattr(compare_paper, "compare", stop)
    with pytest.raises(SystemExit):
        compare.main([])
    base = captured["base"]
    assert (base.dense_steps, base.steps, base.block_size, base.codec, base.seed) == (10, 60, 128, "tagc", 1337)


# ----------------------------------------------------------------------------- diagnostics


def test_parameter_groups_follow_tagcs_selection_through_the_wrappers_names():
    group = diagnostics.parameter_group
    assert group("transformer.wte.weight", 2) == group("lm_head.weight", 2) == "embedding"
    assert group("transformer.h.0.mlp.c_fc.parametrizations.weight.original", 2) == "linear"
    assert group("_fsdp_wrapped_module.transformer.h.3.attn.c_proj.weight", 2) == "linear"
    assert group("transformer.h.0.attn.c_attn.weight", 2) == "attention"
    assert group("transformer.wpe.weight", 2) == group("transformer.h.0.ln_1.weight", 1) == "other"
    assert group("transformer.h.0.mlp.c_fc.bias", 1) == "other"


def test_ages_count_steps_since_the_residual_was_last_zero():
    ages = diagnostics.StaleAges()
    sequence = [
        torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
        torch.tensor([[1.0, 0.0, 1.0, 1.0]]),
        torch.tensor([[1.0, 1.0, 1.0, 1.0]]),
        torch.tensor([[0.0, 1.0, 1.0, 1.0]]),
    ]
    for residual in sequence:
        counts = ages.update({"unit": [residual]})
    assert ages.ages[("unit", 0)].tolist() == [[0, 2, 4, 3]]  # element 2 never sent: one more each step
    # bins 0, 1, 2-3, 4-7, ...
    assert counts.tolist()[:4] == [1.0, 0.0, 2.0, 1.0] and sum(counts.tolist()) == 4


def test_under_ef21_an_element_counts_as_sent_when_its_shift_moved():
    """EF21's residual is ``-h_i``: zero only where the shift is, so an element is sent when its residual changed."""
    ages = diagnostics.StaleAges(changed=True)
    sequence = [
        torch.tensor([[0.0, -1.0, 0.0, 0.0]]),  # from h = 0: element 1 sent
        torch.tensor([[-2.0, -1.0, 0.0, 0.0]]),  # element 0 sent
        torch.tensor([[-2.0, -1.5, 0.0, 0.0]]),  # element 1 sent again
        torch.tensor([[-2.0, -1.5, 0.0, -3.0]]),  # element 3 sent
    ]
    for residual in sequence:
        ages.update({"unit": [residual]})
    assert ages.ages[("unit", 0)].tolist() == [[2, 1, 4, 0]]  # element 2 never sent; its residual stays 0
    classic = diagnostics.StaleAges()
    for residual in sequence:
        classic.update({"unit": [residual]})
    assert classic.ages[("unit", 0)].tolist() == [[3, 4, 0, 1]]  # zeros read as sent: wrong for EF21
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    # the trainer's diagnostics read the hook's feedback and its fading: codec tagc's EF21 fades by 0.9 unless told
    for settings, changed, decay in [({"feedback": "ef21"}, True, 0.9), ({"feedback": "classic"}, False, 1.0),
                                     ({"feedback": "ef21", "feedback_decay": 1.0}, True, 1.0),
                                     ({"feedback": "ef21", "feedback_decay": 0.5}, True, 0.5)]:
        step = diagnostics.StepDiagnostics(model, optimizer, tagc.hook(**settings), None, "all", 1.0)
        assert (step.ages.changed, step.ages.decay) == (changed, decay), settings


def test_with_fading_shifts_an_element_counts_as_sent_when_it_moved_beyond_its_fade():
    ages = diagnostics.StaleAges(changed=True, decay=0.5)
    sequence = [
        torch.tensor([[0.0, -1.0, 0.0, -4.0]]),  # from h = 0: elements 1 and 3 sent
        torch.tensor([[-2.0, -0.5, 0.0, -2.0]]),  # element 0 sent; 1 and 3 faded
        torch.tensor([[-1.0, -3.0, 0.0, -1.0]]),  # element 1 sent; 0 and 3 faded
    ]
    for residual in sequence:
        ages.update({"unit": [residual]})
    assert ages.ages[("unit", 0)].tolist() == [[1, 0, 3, 2]]  # element 2 never sent


def test_a_fading_set_between_steps_is_read_at_each_step():
    """``hook.set_feedback_decay`` (the trainer's ``--feedback-decay-follows-lr``): each step's fade is the codec's
    value then, so an element only faded by the new value is not counted as sent."""
    hook = tagc.hook(feedback="ef21", feedback_decay=0.5)
    step = diagnostics.StepDiagnostics(torch.nn.Linear(4, 4), torch.optim.AdamW(torch.nn.Linear(4, 4).parameters()),
                                       hook, None, "all", 1.0)
    ages = step.ages
    ages.update({"unit": [torch.tensor([[0.0, -1.0, 0.0, -4.0]])]})  # elements 1 and 3 sent
    hook.set_feedback_decay(0.25)
    ages.update({"unit": [torch.tensor([[-2.0, -0.25, 0.0, -1.0]])]})  # element 0 sent; 1 and 3 faded by 0.25
    assert ages.ages[("unit", 0)].tolist() == [[0, 1, 2, 1]]
    hook.set_feedback_decay(1.0)
    ages.update({"unit": [torch.tensor([[-2.0, -0.25, 0.0, -3.0]])]})  # element 3 sent; 0 and 1 held
    assert ages.ages[("unit", 0)].tolist() == [[1, 2, 3, 0]]


def test_quantiles_from_a_histogram_match_the_values_to_a_bin():
    values = torch.logspace(-8, -2, 10001, dtype=torch.float64).log10()
    low, width = diagnostics.V_RANGE[0], diagnostics.V_BIN
    counts = torch.histc(values, bins=diagnostics.V_BINS, min=low, max=diagnostics.V_RANGE[1]).tolist()
    got = diagnostics.quantiles_from_histogram(counts, low, width, (0.1, 0.5, 0.9))
    assert got == pytest.approx(
        torch.quantile(values, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist(), abs=width
    )
    assert all(math.isnan(q) for q in diagnostics.quantiles_from_histogram([0, 0], 0, 1, (0.5,)))


def test_step_diagnostics_measure_the_adamw_update_and_its_second_moment(tmp_path):
    """One process, no process group: the logged statistics equal those computed from the tensors directly."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"wte": torch.nn.Embedding(50, 8), "mlp": torch.nn.ModuleDict({"c_fc": torch.nn.Linear(8, 16)})}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    path = tmp_path / "d.jsonl"
    diag = diagnostics.StepDiagnostics(model, opt, None, str(path), "non-attn", 1.0, header={"run": "x"})
    for step in range(3):
        loss = (model["mlp"]["c_fc"](model["wte"](torch.arange(10))) ** 2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = model["mlp"]["c_fc"].weight.detach().clone()
        diag.before_step()
        opt.step()
        opt.zero_grad()
        record = diag.after_step(step, 0.01, norm, dense=True)
    diag.close()
    weight = model["mlp"]["c_fc"].weight
    delta_rms = (weight.detach() - before).double().square().mean().sqrt().item()
    linear = record["groups"]["linear"]
    assert linear["n"] == weight.numel() and linear["update_rms"] == pytest.approx(delta_rms / 0.01, rel=1e-9)
    v = opt.state[weight]["exp_avg_sq"].double()
    assert linear["v_mean"] == pytest.approx(v.mean().item(), rel=1e-9)
    assert linear["v_geomean"] == pytest.approx(10 ** v.log10().mean().item(), rel=1e-9)
    assert linear["v_p50"] == pytest.approx(torch.quantile(v, 0.5).item(), rel=0.03)
    assert record["grad_norm"] == pytest.approx(float(norm)) and record["clipped"] == (float(norm) > 1.0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["header"] and lines[0]["compressed_groups"] == ["embedding", "linear"] and len(lines) == 4


def test_an_estimate_summary_divides_out_the_ranks_and_estimates_the_noise_of_the_mean():
    """Two ranks' sums: every field but own_sq was counted once per rank; the noise of the mean of N gradients is
    the ranks' spread over N (N - 1)."""
    world = 2
    # d = (1, 1), m = (1, 0), g_0 = (2, 0), g_1 = (0, 0): |d - m|^2 = 1, sum_i |g_i - m|^2 = 2
    summary = diagnostics.estimate_summary([2 * 2, 2 * 1.0, 2.0, 2 * 1.0, 2 * 1.0], world)
    assert summary["n"] == 2 and summary["error_sq"] == 1.0 and summary["noise_sq"] == 1.0
    assert summary["error_to_noise"] == 1.0 and summary["gain"] == 1.0
    assert diagnostics.estimate_summary([0.0] * 5, world) is None
    assert math.isnan(diagnostics.estimate_summary([1.0, 1.0, 0.0, 1.0, 1.0], 1)["noise_sq"])


def _estimate_on_ddp(rank: int, world: int, path: str) -> list:
    """The diagnostics' estimate on DDP with TAGC's defaults, and the same numbers from the ranks' own gradients."""
    import copy

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(64, 192), "c_proj": nn.Linear(192, 48)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp["c_proj"](torch.relu(self.mlp["c_fc"](x)))

    torch.manual_seed(0)
    module = Block()
    ddp = DistributedDataParallel(module, bucket_cap_mb=0.03)
    hook = tagc.hook(select="all", dense_steps=0, min_compress_numel=1)
    tagc.register_comm_hook(ddp, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    diag = diagnostics.StepDiagnostics(ddp.module, opt, hook, path if rank == 0 else None, "all", 1.0,
                                       header={"run": "x"} if rank == 0 else None, replicated=True)
    results = []
    for step in range(4):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 64, generator=generator), torch.randn(16, 48, generator=generator)
        local = copy.deepcopy(module)
        nn.functional.mse_loss(local(x), y).backward()
        own = torch.cat([p.grad.reshape(-1).double() for p in local.mlp.parameters() if p.dim() == 2])
        gathered = [torch.empty_like(own) for _ in range(world)]
        dist.all_gather(gathered, own)
        mean = torch.stack(gathered).mean(0)
        nn.functional.mse_loss(ddp(x), y).backward()
        decoded = torch.cat([p.grad.reshape(-1).double() for p in module.mlp.parameters() if p.dim() == 2])
        diag.after_backward()
        diag.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        record = diag.after_step(step, 1e-2, torch.tensor(1.0), dense=False)
        expected = {
            "error_sq": (decoded - mean).square().sum().item(),
            "noise_sq": sum((g - mean).square().sum().item() for g in gathered) / (world * (world - 1)),
            "signal_sq": mean.square().sum().item(),
            "gain": ((decoded * mean).sum() / mean.square().sum()).item(),
        }
        results.append((record and record.get("estimate", {}).get("linear"), expected, len(diag._own)))
    diag.close()
    return results


def test_the_estimate_sets_the_decoded_gradient_against_the_exact_mean_and_its_minibatch_noise(tmp_path):
    """On 2 DDP ranks with ``tagc.hook()``'s defaults: the logged estimate of the linears equals the one computed from
    each rank's own gradient (a copy of the model, no hook), a compressed step has an error (the codec is lossy), and
    the copies of the ranks' own gradients are dropped every step."""
    from tests.distributed import run_ranks

    results = run_ranks(_estimate_on_ddp, 2, str(tmp_path / "d.jsonl"))[0]
    measured = [(record, expected) for record, expected, _ in results if record]
    assert len(measured) >= 2  # DDP's first step reduces as DDP does (its buckets are rebuilt): none kept then
    for record, expected in measured:
        for field in ("error_sq", "noise_sq", "signal_sq", "gain"):
            assert record[field] == pytest.approx(expected[field], rel=1e-9), field
        assert record["error_sq"] > 0 and record["error_to_noise"] == pytest.approx(
            expected["error_sq"] / expected["noise_sq"], rel=1e-9)
    assert all(kept == 0 for _, _, kept in results)
    lines = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert sum("estimate" in line for line in lines) == len(measured)


def _diag_log(path, name, norms, update, v, stale=None, compression="non-attn", estimate=None):
    header = {
        "header": True,
        "run": name,
        "compression": compression,
        "grad_clip": 1.0,
        "compressed_groups": list(diagnostics.COMPRESSED_GROUPS[compression]),
    }
    lines = [header]
    for step, norm in enumerate(norms):
        groups = {
            g: {
                "n": 100 if g == "embedding" else 300,
                "update_rms": update * (2 if g == "attention" else 1),
                "v_mean": v,
                "v_geomean": v,
                "v_p50": v,
                "v_p90": 2 * v,
            }
            for g in diagnostics.GROUPS
        }
        record = {"step": step, "lr": 1e-3, "grad_norm": norm, "clipped": norm > 1.0, "groups": groups}
        if stale:
            record["staleness"] = {"counts": stale, "elements": sum(stale), "sent": stale[0] / sum(stale)}
        if estimate:  # {group: (error_sq, noise_sq, signal_sq, gain)}
            record["estimate"] = {g: dict(zip(("error_sq", "noise_sq", "signal_sq", "gain"), values))
                                  for g, values in estimate.items()}
        lines.append(record)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_comparison_sets_a_run_against_plain_at_the_same_steps(tmp_path):
    stale = [1, 1, 2, 0, 4, 0, 0, 0, 0, 0]
    _diag_log(tmp_path / "plain.diagnostics.jsonl", "plain", [2.0, 0.5, 0.5, 0.5], 0.5, 1e-8, compression="none")
    # pooled over the compressed groups (attention's left out): error 1 + 3 over noise 2 + 2, gain (0.5 + 3) / (1 + 3)
    estimate = {"embedding": (1.0, 2.0, 1.0, 0.5), "linear": (3.0, 2.0, 3.0, 1.0), "attention": (9.0, 1.0, 1.0, 0.0)}
    _diag_log(tmp_path / "tagc.diagnostics.jsonl", "tagc", [2.0, 1.5, 0.5, 0.6], 0.4, 3e-8, stale=stale,
              estimate=estimate)
    (tmp_path / "tagc.jsonl").write_text("")
    result = diagnostics.compare_runs(tmp_path / "plain.diagnostics.jsonl", tmp_path / "tagc.jsonl", windows=2)
    assert result["groups"] == ["embedding", "linear"]
    assert [r["update_rms_ratio"] for r in result["per_step"]] == pytest.approx(
        [0.8] * 4
    )  # the attention group's 2x is left out
    assert [r["v_mean_ratio"] for r in result["per_step"]] == pytest.approx([3.0] * 4)
    first, second = result["windows"]
    assert (first["plain_clip_fraction"], first["run_clip_fraction"], second["run_clip_fraction"]) == (0.5, 1.0, 0.0)
    assert first["grad_norm_ratio"] == pytest.approx((1 + 3) / 2) and first["stale_8_plus"] == pytest.approx(0.5)
    assert result["staleness_histogram"] == [4 * c for c in stale]
    assert (first["run_error_to_noise"], first["run_gain"]) == pytest.approx((1.0, 3.5 / 4))
    assert (
        diagnostics.main(
            [
                str(tmp_path / "plain.jsonl"),
                str(tmp_path / "tagc.diagnostics.jsonl"),
                "--out",
                str(tmp_path / "out"),
                "--windows",
                "2",
            ]
        )
        == 0
    )
    report = (tmp_path / "out" / "diagnostics-tagc-vs-plain.md").read_text()
    assert "| 0-1 | 50% | 100% | 2.000 | 0.800 | 3.000 | 3.000 | 12.5% | 50.0% | 1.000 | 0.875 |" in report
    assert diagnostics.main([str(tmp_path / "none.jsonl"), str(tmp_path / "tagc.jsonl")]) == 1
