"""`python -m roformer.bench levers`: the speed levers' A/B in one process."""
import json

import numpy as np
import pytest

from roformer import cli
from roformer.bench import levers
from roformer.bench.__main__ import main


def flags_of(argv: list[str]):
    """The levers benchmark's flags as its command line gives them (without --json)."""
    command = cli.CommandFlags("levers")
    levers.define_flags(command)
    args, _ = command.parse(argv)
    args.json = None
    return args


@pytest.mark.slow   # builds every variant's train step: minutes on 2 cores
def test_levers_time_each_variant_against_the_baseline_with_its_own_program(tmp_path, capsys, monkeypatch):
    # Whichever lever won on this CPU, `adopted` is fused_qkv alone here: then built and timed.
    monkeypatch.setattr(levers, "adopted_variant", lambda rows, threshold: (levers.VARIANTS["fused_qkv"], ["x"]))
    out = tmp_path / "levers.json"
    assert main(["levers", "--shapes", "tiny/16/2", "--variants", "all_batch_x2",
                 "--rounds", "1", "--iters", "1", "--vocab-size", "128", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    stages = [(row["stage"], row["variant"]) for row in result["rows"]]
    assert stages == [("levers", "baseline"), ("levers", "all_batch_x2"), ("adopted", "baseline"),
                      ("adopted", "adopted")]   # the baseline is always measured
    assert result["rows"][3]["forms"] == ["fused_qkv"]
    rows = {row["variant"]: row for row in result["rows"][:2]}
    assert rows["baseline"]["x_tokens"] == 1 and rows["baseline"]["dloss_step1"] == 0
    assert rows["all_batch_x2"]["batch"] == 4 and rows["all_batch_x2"]["dropout_rng"] == "rbg"
    assert rows["all_batch_x2"]["forms"] == list(levers.ALL_FORMS)
    assert rows["baseline"]["program"] != rows["all_batch_x2"]["program"]
    assert result["partial"] is False and "| all_batch_x2 |" in capsys.readouterr().out


@pytest.mark.fast
def test_budget_refuses_a_build_the_longest_so_far_says_would_end_past_it():
    budget = levers.Budget(10.0)
    assert budget.allows_build()
    budget.built(9.0)
    assert not budget.allows_build()
    unlimited = levers.Budget(0.0)
    unlimited.built(1e6)
    assert unlimited.allows_build()


@pytest.mark.fast
@pytest.mark.parametrize("fused_build_s, confirmation", [(10, "timed"), (20, "not timed")])
def test_the_budget_keeps_a_build_for_the_adopted_levers_confirmation(monkeypatch, fused_build_s, confirmation):
    """Builds take 10 s of a fake clock. Without the kept build, 45 s built every lever and then
    had no room for the adopted set, so nothing could be adopted. When a build takes longer than
    the forecast (20 s) and leaves no room, the note says the set was not timed, not that it did
    not pay."""
    import types

    clock = [0.0]

    def build(size, seq_len, batch, variant, args):
        clock[0] += fused_build_s if variant.forms == ("fused_qkv",) else 10.0
        return object(), {"loss": 1.0, "grad_norm": 1.0}

    def time(self, stage):   # every built variant, timed as paying
        return [{"stage": stage, "variant": name, "x_tokens": 1.1, "x_tokens_min": 1.05} for name in self.built]

    monkeypatch.setattr(levers, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(levers, "build", build)
    monkeypatch.setattr(levers.Group, "time", time)
    args = flags_of(["--shapes", "tiny/16/2", "--budget-s", "45", "--variants=rope_half_pairs,fused_qkv,rbg_dropout"])
    args.json = None
    result = levers.run(args)
    stages = [(row["stage"], row["variant"]) for row in result["rows"]]
    if confirmation == "timed":
        assert stages == [("levers", "baseline"), ("levers", "rope_half_pairs"), ("levers", "fused_qkv"),
                          ("adopted", "baseline"), ("adopted", "adopted")]
        assert "tiny/16/2 rbg_dropout: not built, past the 45 s budget with a build kept for the adopted " \
               "levers' confirmation" in result["notes"]
        assert not any(note.startswith("adopted: none") for note in result["notes"])
    else:
        assert stages == [("levers", "baseline"), ("levers", "rope_half_pairs"), ("levers", "fused_qkv")]
        assert "tiny/16/2 adopted: not built, past the 45 s budget" in result["notes"]
        assert result["notes"][-1] == ("adopted: none (the levers together were not timed in rounds of their "
                                       "own: see the note above at tiny/16/2)")


@pytest.mark.fast
def test_program_digest_reads_the_instructions_not_where_they_were_traced_from():
    def program(op, frame):
        text = ('HloModule m\nFileNames\n1 "a.py"\nENTRY %main {\n'
                f'  %p = f32[] parameter(0), metadata={{op_name="x" stack_frame_id={frame}}}\n'
                f'  ROOT %r = f32[] {op}(%p, %p), metadata={{op_name="y"}}, stack_frame_id={frame}\n}}\n')
        return type("Workload", (), {"step_fn": type("Step", (), {"as_text": staticmethod(lambda: text)})})

    assert levers.program_digest(program("add", 3)) == levers.program_digest(program("add", 7))
    assert levers.program_digest(program("add", 3)) != levers.program_digest(program("multiply", 3))


@pytest.mark.fast
def test_adopted_are_the_levers_that_paid_in_every_round_together():
    def row(variant, median, low):
        return {"variant": variant, "x_tokens": median, "x_tokens_min": low}

    rows = [row("baseline", 1, 1), row("all", 1.2, 1.1), row("fused_qkv", 1.02, 1.01),
            row("rbg_dropout", 1.03, 1.001), row("rope_half_pairs", 1.02, 0.99), row("bf16_mlm_logits", 1.001, 1.0005)]
    variant, paid = levers.adopted_variant(rows, 1.005)
    assert paid == ["fused_qkv", "rbg_dropout"]
    assert variant == levers.Variant(forms=("fused_qkv",), dropout_rng_impl="rbg")
    assert levers.adopted_variant(rows[:2], 1.005) == (None, [])
    # Not adopted however fast: a lever whose first-step loss is off the baseline's beyond bf16
    # rounding (rbg keys draw other masks by design), one that compiled to the baseline's own
    # program, one that failed to build.
    rows = [{**row("baseline", 1, 1), "program": "p0"},
            {**row("fused_qkv", 1.1, 1.05), "dloss_step1": 0.3, "program": "p1"},
            {**row("rbg_dropout", 1.03, 1.01), "dloss_step1": -0.0073, "program": "p2"},
            {**row("fused_mlm_loss", 1.02, 1.01), "dloss_step1": 0.0, "program": "p0"},
            {"variant": "pallas_residual_norm", "failed": "LoweringError"}]
    verdicts = levers.lever_verdicts(rows, 1.005)
    assert verdicts["fused_qkv"].startswith("first-step loss +0.3 off") and verdicts["rbg_dropout"] == "paid"
    assert verdicts["fused_mlm_loss"] == "the baseline's own program"
    assert verdicts["pallas_residual_norm"] == "failed (LoweringError)"
    assert levers.adopted_variant(rows, 1.005)[1] == ["rbg_dropout"]
    # Nor one whose backward is off where its forward is right (the first-step loss is taken
    # before the update), nor one whose first step is not finite, nor any against a baseline
    # whose first step is not: NaN compares false with every tolerance.
    fast = {"x_tokens": 1.1, "x_tokens_min": 1.05, "program": "p9", "loss_step1": 6.26}
    rows = [{**row("baseline", 1, 1), "program": "p0", "loss_step1": 6.26},
            {**fast, "variant": "fused_mlm_loss", "dloss_step1": 0.0, "dgrad_step1": -0.13},
            {**fast, "variant": "fused_qkv", "dloss_step1": 1e-5, "dgrad_step1": 4e-4},
            {**fast, "variant": "rope_half_pairs", "loss_step1": float("nan"), "dloss_step1": float("nan")},
            {**fast, "variant": "rbg_dropout", "loss_step1": float("inf"), "dloss_step1": float("inf")}]
    verdicts = levers.lever_verdicts(rows, 1.005)
    assert verdicts["fused_mlm_loss"] == "first-step gradient norm -0.13 (relative) off the baseline's"
    assert verdicts["fused_qkv"] == "paid"
    assert verdicts["rope_half_pairs"] == "first-step loss nan" and verdicts["rbg_dropout"] == "first-step loss inf"
    nan_base = [{**rows[2], "dloss_step1": float("nan"), "dgrad_step1": float("nan")}]
    assert levers.lever_verdicts(nan_base, 1.005)["fused_qkv"] == "first-step loss +nan off the baseline's"


@pytest.mark.fast
def test_the_adopted_levers_are_read_back_from_a_runs_json():
    """From the first shape's lever rows only: another shape's rows of the same names (with
    --other-variants) do not count, nor do the adopted stage's."""
    def row(stage, size, variant, median, low):
        return {"stage": stage, "size": size, "seq": 512, "variant": variant, "x_tokens": median, "x_tokens_min": low}

    rows = [row("levers", "base", "baseline", 1, 1), row("levers", "base", "fused_qkv", 1.02, 1.01),
            row("levers", "base", "rbg_dropout", 0.99, 0.98), row("adopted", "base", "baseline", 1, 1),
            row("adopted", "base", "fused_qkv", 1.015, 1.002), row("levers", "small", "rbg_dropout", 1.05, 1.04)]
    result = json.loads(json.dumps({"rows": rows, "settings": {"shapes": ["base/512/64", "small/512/64"],
                                                               "adopt_above": 1.005}}))
    assert levers.adopted_in_result(result) == levers.Variant(forms=("fused_qkv",))
    result["settings"]["adopt_above"] = 1.05
    assert levers.adopted_in_result(result) is None
    # The levers together timed again in rounds of their own: not paying there, or failing to
    # build, hands on no lever.
    result["settings"]["adopt_above"] = 1.005
    result["rows"][4].update(x_tokens=0.97, x_tokens_min=0.96)
    assert levers.adopted_in_result(result) is None
    result["rows"][4] = {"stage": "adopted", "size": "base", "seq": 512, "variant": "adopted", "failed": "OOM"}
    assert levers.adopted_in_result(result) is None
    # Levers right alone can be wrong together: a set whose first step is off is not adopted,
    # however fast; with rbg keys among them its loss differs by design, so only finiteness counts.
    together = {"stage": "adopted", "size": "base", "seq": 512, "variant": "adopted", "x_tokens": 1.04,
                "x_tokens_min": 1.02, "loss_step1": 6.2, "dloss_step1": 0.0, "dgrad_step1": 0.05,
                "dropout_rng": "threefry2x32"}
    assert levers.not_confirmed([together], 1.005) == (
        "changed the first step (first-step gradient norm +0.05 (relative) off the baseline's)")
    assert levers.not_confirmed([{**together, "dropout_rng": "rbg", "dloss_step1": 0.01}], 1.005) is None
    assert levers.not_confirmed([{**together, "dropout_rng": "rbg", "loss_step1": float("nan")}], 1.005) == (
        "changed the first step (first-step loss nan)")
    assert levers.not_confirmed([{**together, "dgrad_step1": 1e-3}], 1.005) is None
    assert levers.not_confirmed([{**together, "dgrad_step1": 1e-3, "x_tokens": 0.99}], 1.005) == (
        "did not pay in their own rounds")
    # A later shape of the same size and length but another batch does not count.
    result["rows"][4] = row("adopted", "base", "fused_qkv", 1.015, 1.002)
    result["rows"].append({**row("levers", "base", "fused_qkv", 0.95, 0.9), "batch": 128})
    for r in result["rows"][:5]:
        r["batch"] = 64
    assert levers.adopted_in_result(result) == levers.Variant(forms=("fused_qkv",))


def test_the_segment_mask_variant_is_the_baseline_with_the_packed_rows_mask():
    """One segment per row: the same attention as no mask, so the same first loss; only the
    form cuDNN gets differs (a dense [B, 1, L, L] mask)."""
    from roformer.bench.workload import build_train_workload
    from roformer.model import ModelConfig

    config = ModelConfig.from_preset("tiny", vocab_size=128, attention_dropout=0.0, hidden_dropout=0.0)
    plain = build_train_workload(config, batch_size=2, seq_len=16, attention_impl="xla")
    masked = build_train_workload(config, batch_size=2, seq_len=16, attention_impl="xla", segment_mask=True)
    assert "segment_ids" in masked.batch and "segment_ids" not in plain.batch
    assert levers.VARIANTS["segment_mask"].segment_mask and "segment_mask" not in levers.LEVERS
    np.testing.assert_allclose(float(masked.step()[1]["loss"]), float(plain.step()[1]["loss"]), rtol=1e-6)


@pytest.mark.fast
def test_a_variant_that_fails_to_build_is_a_row_saying_why_and_the_rest_still_run(monkeypatch):
    """A kernel that does not lower on the device is reported in the table, not a crash of
    the A/B, and is never adopted."""

    def build(size, seq_len, batch, variant, args):
        if "pallas_residual_norm" in variant.forms:
            raise RuntimeError("Triton lowering failed\nthe rest of the message")
        return object(), {"loss": 1.0, "grad_norm": 1.0}

    def time(self, stage):   # every built variant, timed as paying
        return [{"stage": stage, "variant": name, "x_tokens": 1.1, "x_tokens_min": 1.05} for name in self.built]

    monkeypatch.setattr(levers, "build", build)
    monkeypatch.setattr(levers.Group, "time", time)
    args = flags_of(["--shapes", "tiny/16/2", "--variants=pallas_residual_norm,fused_qkv"])
    args.json = None
    result = levers.run(args)
    rows = [(row["stage"], row["variant"], row.get("failed")) for row in result["rows"]]
    assert rows == [("levers", "baseline", None), ("levers", "fused_qkv", None),
                    ("levers", "pallas_residual_norm", "RuntimeError: Triton lowering failed"),
                    ("adopted", "baseline", None), ("adopted", "fused_qkv", None)]   # confirmed in rounds of its own
    assert any("pallas_residual_norm: failed (RuntimeError" in note for note in result["notes"])
    assert "adopted (the levers that paid alone at tiny/16/2, together): fused_qkv, the same as fused_qkv" \
        in result["notes"]
    assert "failed" in levers.TABLE_COLUMNS
    assert "pallas_residual_norm" not in levers.ALL_FORMS and "pallas_residual_norm" in levers.LEVERS


def test_a_later_call_times_the_adopted_levers_of_an_earlier_run_at_the_shapes_it_left(tmp_path):
    """--adopted-from: the levers are not measured again; each shape times the baseline and the
    earlier run's adopted variant, and this run's JSON hands the same variant on (to ab_hf)."""
    def row(variant, median, low):
        return {"stage": "levers", "size": "tiny", "seq": 16, "variant": variant, "x_tokens": median,
                "x_tokens_min": low}

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"benchmark": "levers", "rows": [row("baseline", 1, 1), row("fused_qkv", 1.1, 1.05),
                                                                     row("rope_half_pairs", 0.9, 0.8),
                                                                     {**row("fused_qkv", 1.08, 1.02), "stage": "adopted"}],
                                   "settings": {"shapes": ["tiny/16/2"], "adopt_above": 1.005}}))
    out = tmp_path / "later.json"
    assert main(["levers", "--shapes", "tiny/16/2", "--adopted-from", str(earlier), "--rounds", "1",
                 "--iters", "1", "--vocab-size", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # the first shape as the others: no lever alone, the adopted variant against the baseline
    assert [(r["stage"], r["size"], r["seq"], r["variant"]) for r in result["rows"]] == [
        ("levers", "tiny", 16, "baseline"), ("levers", "tiny", 16, "adopted")]
    assert all(r["forms"] == ["fused_qkv"] for r in result["rows"] if r["variant"] == "adopted")
    assert levers.adopted_in_result(result) == levers.Variant(forms=("fused_qkv",))
    assert any("taken from" in note and "fused_qkv" in note for note in result["notes"])
    # a run whose levers paid nowhere hands on "none": the baseline alone
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"benchmark": "levers", "rows": [row("baseline", 1, 1)],
                                "settings": {"shapes": ["tiny/16/2"], "adopt_above": 1.005}}))
    assert main(["levers", "--shapes", "tiny/16/2", "--adopted-from", str(none), "--rounds", "1", "--iters", "1",
                 "--vocab-size", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["baseline"] and levers.adopted_in_result(result) is None


@pytest.mark.fast
@pytest.mark.parametrize("content", [None, "not json", '{"benchmark": "hf", "rows": []}'])
def test_adopted_from_a_file_that_is_not_a_levers_result_is_one_line(tmp_path, content):
    path = tmp_path / "earlier.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match="--adopted-from .*earlier.json: cannot take its adopted levers") as error:
        main(["levers", "--shapes", "tiny/16/2", "--adopted-from", str(path)])
    assert "\n" not in str(error.value)


def test_the_decision_rules_simulation_runs_the_projects_own_rules(capsys, monkeypatch):
    """scripts/decision_rules_sim.py (docs/results/2026-11-29-decision-rules-cpu.md) at a few
    trials: its three tables, from study_stats.family_verdicts and levers.paid."""
    import runpy
    import sys
    from pathlib import Path

    monkeypatch.setattr(sys, "argv", ["decision_rules_sim.py", "--trials", "200"])
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "decision_rules_sim.py"),
                   run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("|---|---|---|---|") == 3 and "| 6 |" in out and "| 1.02x | 1.0% |" in out
