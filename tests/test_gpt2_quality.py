"""The quality protocol over seeds, the per-step diagnostics and the library's defaults in the trainer."""

import json
import math

import pytest
import torch

import tagc
from gpt2_bench import compare, compare_paper, compare_runs, diagnostics, quality
from gpt2_bench.config import TrainConfig, build_parser, config_from_args


def _result(evals: dict[int, float]) -> dict:
    steps = sorted(evals)
    return {
        "val_loss": evals[steps[-1]],
        "steps": steps[-1] + 1,
        "curve": [{"step": s, "loss": 9.0, "val_loss": evals[s]} for s in steps],
    }


def test_the_gap_is_paired_by_seed_and_a_gap_inside_the_spread_is_a_tie():
    by_seed = {
        0: {
            "fsdp": _result({9: 6.0, 19: 5.0}),
            "int4": _result({9: 6.06, 19: 5.01}),
            "tagc": _result({9: 6.3, 19: 5.2}),
        },
        1: {
            "fsdp": _result({9: 6.2, 19: 5.1}),
            "int4": _result({9: 6.2, 19: 5.1}),
            "tagc": _result({9: 6.51, 19: 5.304}),
        },
    }
    gaps = quality.seed_gaps(by_seed)
    int4, tagc = gaps["int4"], gaps["tagc"]
    assert [r["step"] for r in int4] == [9, 19]
    assert int4[0]["gap"] == pytest.approx(100 * (6.06 / 6.0 - 1 + 0) / 2)  # paired: seed 1 is a 0% gap
    assert int4[0]["plain_spread"] == pytest.approx(100 * 0.2 / 6.1)
    assert int4[0]["spread"] == pytest.approx(100 * 0.14 / 6.13)
    assert int4[0]["verdict"] == "tie" and tagc[0]["verdict"] == "behind"  # tagc: +5% > plain's 3.3% spread
    assert tagc[1]["gap"] == pytest.approx(100 * (5.2 / 5.0 - 1 + 5.304 / 5.1 - 1) / 2)
    assert gaps["fsdp"][0]["gap"] == 0 and gaps["fsdp"][0]["verdict"] is None
    report = quality.format_seeds_report(by_seed, 20, plateau=7.0, tokens_per_step=1024)
    assert "| 9 | 6.1000 | 6.1300 | +0.50% | +1.00, +0.00 | 3.28% | 2.28% | tie |" in report
    assert "- `tagc`: +4.00% at step 19" in report
    assert "outside 1% at 2 of 2 evaluations from step 9 on (largest +5.00% at step 9)" in report
    assert "- `int4`: +0.10% at step 19" in report and "within 1% at every evaluation from step 9 on" in report
    assert "20,480 in a run" in report


def test_one_seed_states_no_spread_and_calls_no_tie():
    rows = quality.seed_gaps({0: {"fsdp": _result({4: 6.0}), "tagc": _result({4: 6.001})}})["tagc"]
    assert rows[0]["spread"] is None and rows[0]["verdict"] is None and rows[0]["gap"] == pytest.approx(100 / 6000)
    with pytest.raises(ValueError, match="fsdp"):
        quality.seed_gaps({0: {"tagc": _result({4: 6.0})}})


def test_seeds_parse_and_mean_quality_averages_over_seeds():
    assert quality.parse_seeds("0, 1,7") == (0, 1, 7)
    for bad in ("", "0,0", "a,1"):
        with pytest.raises(ValueError, match="--seeds"):
            quality.parse_seeds(bad)
    mean = quality.mean_quality(
        {0: {"fsdp": _result({4: 6.0}), "x": _result({4: 1.0})}, 1: {"fsdp": _result({4: 7.0})}}
    )
    assert set(mean) == {"fsdp"} and mean["fsdp"]["val_loss"] == pytest.approx(6.5)


def test_seeded_quality_runs_keep_each_seed_apart(tmp_path, monkeypatch):
    seen = []

    def fake_run(cfg, data_dir, link, attempts):
        seen.append((cfg.seed, cfg.out_dir, cfg.name))
        return {"val_loss": 6.0 + cfg.seed, "curve": [], "steps": cfg.steps}

    monkeypatch.setattr(compare_runs, "run", fake_run)
    base = TrainConfig(preset="tiny", out_dir=str(tmp_path))
    by_seed = compare_runs.seeded_quality_runs(base, ("fsdp", "int4"), 10, "unused", (0, 3))
    assert by_seed[3]["int4"]["val_loss"] == 9.0
    assert seen == [
        (0, str(tmp_path / "quality" / "seed-0"), "fsdp"),
        (0, str(tmp_path / "quality" / "seed-0"), "int4"),
        (3, str(tmp_path / "quality" / "seed-3"), "fsdp"),
        (3, str(tmp_path / "quality" / "seed-3"), "int4"),
    ]


# ----------------------------------------------------------------------------- defaults from the library


def test_dense_steps_default_to_the_librarys_unless_a_flag_says_otherwise():
    from tagc.hooks.engine import DENSE_STEPS

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
    assert linear["n"] == weight.numel() and linear["delta_rms"] == pytest.approx(delta_rms, rel=1e-9)
    assert linear["update_rms"] == pytest.approx(delta_rms / 0.01, rel=1e-9)
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
    summary = diagnostics.estimate_summary([2 * 2, 2 * 1.0, 2.0, 2 * 1.0, 2 * 1.0, 2 * 2.0], world)
    assert summary["n"] == 2 and summary["error_sq"] == 1.0 and summary["noise_sq"] == 1.0
    assert summary["error_to_noise"] == 1.0 and summary["gain"] == 1.0
    assert summary["cosine"] == pytest.approx(1 / math.sqrt(2))
    assert diagnostics.estimate_summary([0.0] * 6, world) is None
    assert math.isnan(diagnostics.estimate_summary([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], 1)["noise_sq"])


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
    assert (tmp_path / "out" / "diagnostics-tagc-vs-plain.png").stat().st_size > 0
    assert diagnostics.main([str(tmp_path / "none.jsonl"), str(tmp_path / "tagc.jsonl")]) == 1


def test_the_seeds_report_reads_trainer_logs_laid_out_by_seed(tmp_path):
    import json

    from gpt2_bench.quality import main, read_runs

    losses = {(0, "fsdp"): 4.0, (0, "ours"): 4.4, (1, "fsdp"): 5.0, (1, "ours"): 5.25, (0, "ctl"): 4.2, (1, "ctl"): 5.0}
    for (seed, name), val in losses.items():
        folder = tmp_path / f"seed-{seed}"
        folder.mkdir(exist_ok=True)
        lines = [{"step": 0, "loss": 9.0}, {"step": 1, "loss": 8.0, "val_loss": val}, {"summary": True}]
        (folder / f"{name}.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
        (folder / f"{name}.diagnostics.jsonl").write_text("{}\n")
    by_seed = read_runs(tmp_path, ["ours"])
    assert sorted(by_seed[0]) == ["fsdp", "ours"] and by_seed[1]["ours"]["val_loss"] == 5.25
    assert main([str(tmp_path), "--methods", "ours"]) == 0
    report = (tmp_path / "quality.md").read_text()
    assert "| 1 | 4.5000 | 4.8250 | +7.50% | +10.00, +5.00 |" in report  # mean of the paired gaps
    main([str(tmp_path), "--methods", "ours", "--plain", "ctl", "--out", str(tmp_path / "vs-ctl.md")])
    against = (tmp_path / "vs-ctl.md").read_text()
    assert "+4.88%" in against and "against ctl's" in against  # (4.4/4.2 - 1 + 5.25/5 - 1) / 2
    assert (tmp_path / "vs-ctl.png").exists()
    main([str(tmp_path), "--methods", "ours", "--tolerance", "10", "--out", str(tmp_path / "ten.md")])
    assert "mean gap within 10% at every evaluation" in (tmp_path / "ten.md").read_text()  # +7.50% is within 10%
    main([str(tmp_path), "--methods", "ours", "--tolerance", "0.5", "--out", str(tmp_path / "half.md")])
    assert "mean gap outside 0.5% at 1 of 1 evaluations" in (tmp_path / "half.md").read_text()
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--tolerance", "0"])


def test_the_seeds_report_reads_curves_kept_in_the_repository(tmp_path):
    """``--rows``: the curve files of docs/rows (``{"runs": {"seed-N/<method>": {"val_loss": [[step, loss]]}}}``) give
    the same report as the logs they came from; a run in a later file replaces the same run of an earlier one."""
    import json

    from gpt2_bench.quality import main, read_rows

    first = {"runs": {"seed-0/ddp": {"val_loss": [[1, 4.0]]}, "seed-1/ddp": {"val_loss": [[1, 5.0]]},
                      "seed-0/ours": {"val_loss": [[1, 9.9]]}}}
    second = {"machine": "another card", "runs": {"seed-0/ours": {"val_loss": [[1, 4.4]], "peak_gpu_mb": 1.0},
                                                  "seed-1/ours": {"val_loss": [[1, 5.25]]}}}
    paths = []
    for name, rows in (("first.json", first), ("second.json", second)):
        (tmp_path / name).write_text(json.dumps(rows))
        paths.append(str(tmp_path / name))
    by_seed = read_rows(paths, ["ours"], plain="ddp")
    assert by_seed[0]["ours"]["val_loss"] == 4.4 and by_seed[1]["fsdp"]["curve"] == [{"step": 1, "val_loss": 5.0}]
    out = tmp_path / "report.md"
    assert main(["--rows", ",".join(paths), "--plain", "ddp", "--methods", "ours", "--out", str(out)]) == 0
    assert "| 1 | 4.5000 | 4.8250 | +7.50% | +10.00, +5.00 |" in out.read_text() and out.with_suffix(".png").exists()
    logged = tmp_path / "logs" / "seed-1"  # a new run's log beside the rows' plain runs: it replaces the rows' run
    logged.mkdir(parents=True)
    (logged / "ours.jsonl").write_text(json.dumps({"step": 1, "val_loss": 5.5}) + "\n")
    assert main([str(tmp_path / "logs"), "--rows", ",".join(paths), "--plain", "ddp", "--methods", "ours"]) == 0
    assert "| 1 | 4.5000 | 4.9500 | +10.00% | +10.00, +10.00 |" in (tmp_path / "logs" / "quality.md").read_text()
    for argv in (["--rows", paths[0]],  # no --out
                 []):  # neither logs nor rows
        with pytest.raises(SystemExit):
            main(argv)
    kept = tmp_path / "kept.json"  # --save-rows: the logs' curves, under their own names, read back the same
    assert main([str(tmp_path / "logs"), "--save-rows", str(kept), "--machine", "here", "--protocol", "the command",
                 "--rows", ",".join(paths), "--plain", "ddp", "--out", str(tmp_path / "kept.md")]) == 0
    assert json.loads(kept.read_text()) == {"machine": "here", "protocol": "the command",
                                            "runs": {"seed-1/ours": {"val_loss": [[1, 5.5]]}}}
    assert read_rows([kept])[1]["ours"]["curve"] == [{"step": 1, "val_loss": 5.5}]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "logs"), "--save-rows", str(kept)])  # no --machine or --protocol
    (tmp_path / "bad.json").write_text(json.dumps({"runs": {"ours": {"val_loss": [[1, 4.0]]}}}))
    with pytest.raises(ValueError, match="seed-N/<method>"):
        read_rows([tmp_path / "bad.json"])


def test_the_seeds_report_leaves_out_a_run_of_another_schedule(tmp_path):
    import json

    from gpt2_bench.quality import read_runs

    folder = tmp_path / "seed-0"
    folder.mkdir()

    def log(name, lrs, tokens_per_step=1024):
        lines = [{"step": i, "loss": 9.0, "lr": lr, "tokens": (i + 1) * tokens_per_step, "val_loss": 5.0 - i}
                 for i, lr in enumerate(lrs)]
        (folder / f"{name}.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    log("fsdp", [1e-3, 9e-4, 8e-4])
    log("same", [1e-3, 9e-4 * (1 + 1e-9), 8e-4])  # float rounding is the same schedule
    log("shorter", [1e-3, 9e-4, 5e-4])  # a shorter cosine schedule decays sooner
    log("bigger-batch", [1e-3, 9e-4, 8e-4], tokens_per_step=4096)
    with pytest.warns(UserWarning) as caught:
        by_seed = read_runs(tmp_path)
    assert sorted(by_seed[0]) == ["fsdp", "same"]
    messages = " ".join(str(w.message) for w in caught)
    assert "shorter.jsonl left out: at step 2" in messages and "bigger-batch.jsonl left out: at step 0" in messages


def test_the_verdict_says_when_the_runs_stop_short_of_the_schedule():
    from gpt2_bench.quality import format_seeds_report

    def run(*losses):
        return {"curve": [{"step": 99 + 100 * i, "val_loss": v} for i, v in enumerate(losses)]}

    by_seed = {0: {"fsdp": run(5.0, 4.0, 3.0), "ours": run(5.02, 4.02)}, 1: {"fsdp": run(5.1, 4.1, 3.1),
                                                                              "ours": run(5.1, 4.1, 3.1)}}
    report = format_seeds_report(by_seed, steps=300)
    assert "Not finished: every seed's runs reach step 199 of 300" in report
    assert "Not finished" not in format_seeds_report(by_seed, steps=200)


def test_a_method_without_every_seed_is_named_and_seeds_can_be_picked(tmp_path):
    import json

    from gpt2_bench.quality import main

    for seed, names in {0: ("fsdp", "ours"), 1: ("fsdp",)}.items():
        folder = tmp_path / f"seed-{seed}"
        folder.mkdir()
        for name in names:
            (folder / f"{name}.jsonl").write_text(json.dumps({"step": 9, "val_loss": 4.0 + seed}) + "\n")
    main([str(tmp_path)])
    assert "- `ours`: not compared: no run for seed 1" in (tmp_path / "quality.md").read_text()
    main([str(tmp_path), "--seeds", "0"])
    assert "- `ours`: +0.00% at step 9 (one seed)" in (tmp_path / "quality.md").read_text()
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--seeds", "0,2"])
