"""A scheme's group of members (roformer/study/groups.py): each member's inputs, compiling
ahead on a worker thread, each budget's divergences, and a group beyond the grid joining its
scheme's record."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.study import config
from roformer.study import plan as study_plan
from roformer.study import session as study


def test_a_member_reads_its_own_seeds_order_and_keys_whatever_its_group_holds():
    """A group of seed 1 alone reads seed 1's row of the pass orders (it read seed 0's when its
    index was its place among the group's seeds), and no step's dropout key is a masking key."""
    from roformer.study.plan import Member
    from roformer.study.groups import member_inputs

    alone = member_inputs([Member(0, 1, 4e-3)])
    full = member_inputs([Member(0, 0, 4e-3), Member(1, 1, 4e-3)])
    assert alone["seed_index"].tolist() == [1] and full["seed_index"].tolist() == [0, 1]
    assert (jax.random.key_data(alone["data_key"]) == jax.random.key_data(full["data_key"][1:])).all()
    dropout_step1 = jax.random.fold_in(full["dropout_key"][1], 1)
    assert not (jax.random.key_data(dropout_step1) == jax.random.key_data(full["data_key"][1])).all()


def test_a_group_compiled_on_a_worker_thread_trains_alike_without_compiling_again(caplog):
    """SchemeRun.compile on CompileAhead's worker thread: the group's training, evaluation and
    signal programs are ready before it runs (nothing compiles while it trains), and the
    group computes what it computes when its first calls compile them."""
    from roformer.study.groups import CompileAhead, SchemeRun

    c = config(schemes="rope", seeds=2, learning_rates="2e-3", budget_steps="2,4")
    data = study.study_splits(study_plan.build_plan(c))
    aux = study.device_arrays(study_plan.build_plan(c), data)
    plain, plain_loss = SchemeRun(study_plan.build_plan(c), "rope", data, aux).run()
    ahead = CompileAhead(lambda scheme: SchemeRun(study_plan.build_plan(c), scheme, data, aux).compile(), groups=1)
    ahead.submit("rope", "rope")
    run = ahead.take("rope", "rope")
    ahead.close()
    assert run.compiled_ahead and run.programs_s > run.init_s > 0
    # Its members' initial states wait on the device: what the memory estimate counts for them
    # (and a step counter per member and moment).
    waiting = sum(x.nbytes for x in jax.tree.leaves(run.states))
    counted = study_plan.initial_state_bytes(run.model_cfg, len(run.group))
    assert counted <= waiting <= counted + 64 * len(run.group)
    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
        record, test_loss = run.run()
    compiled = [r.getMessage()[:40] for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert not [m for m in compiled if any(f"jit({name})" in m for name in ("train_chunk", "evaluate", "signal"))], \
        compiled
    assert record["timing"]["compiled_ahead"] and not plain["timing"]["compiled_ahead"]
    # Evaluation's throughput counts every row it ran, padding included: each trunk evaluation
    # and each earlier budget's validation, and the test rows at every budget.
    padded = lambda rows: -(-len(rows["input_ids"]) // c.study.eval_batch) * c.study.eval_batch  # noqa: E731
    budgets_ = len(record["budgets"])
    assert run.evaluated_rows == (len(record["evals"]) + budgets_ - 1) * padded(run.eval_rows) + \
        budgets_ * padded(data.test)
    assert record["timing"]["eval_tokens_per_s"] == pytest.approx(
        len(run.group) * run.evaluated_rows * c.pretrain.train.seq_len / record["timing"]["eval_s"])
    assert record["budgets"] == plain["budgets"] and record["evals"] == plain["evals"]
    assert test_loss.keys() == plain_loss.keys()
    for key in test_loss:
        np.testing.assert_array_equal(test_loss[key], plain_loss[key])


def test_each_budget_counts_the_divergences_of_its_own_model():
    """A budget's model is its trunk up to the cooldown's fork, then its branch: a member that
    diverges in the trunk after the fork, or in another budget's branch, has not diverged for
    it. A member whose last update is not finite (the training loss is taken before each
    update) is marked by its validation loss at the budget's end."""
    from roformer.study.groups import SchemeRun

    c = config(schemes="rope", seeds=2, learning_rates="1e-3,2e-3", budget_steps="4,8", eval_every=1,
               warmup_steps=1, cooldown_fraction=0.5)
    data = study.study_splits(study_plan.build_plan(c))
    run = SchemeRun(study_plan.build_plan(c), "rope", data, study.device_arrays(study_plan.build_plan(c), data)).compile()
    train_chunk, trunk = run.programs.train_chunk, (4, 8)   # budget 4's branch runs (2, 4)
    poison = lambda states, m: {**states, "params": jax.tree.map(lambda p: p.at[m].set(jnp.nan),  # noqa: E731
                                                                 states["params"])}

    def chunk(states, aux, rest, inputs, start, end):
        step, on_trunk = int(np.asarray(states["step"])[0]), (int(start), int(end)) == trunk
        if step == 3:   # member 3 in the trunk (after budget 4's fork), member 1 in budget 4's branch
            states = poison(states, 3 if on_trunk else 1)
        states, losses = train_chunk(states, aux, rest, inputs, start, end)
        return (poison(states, 0) if on_trunk and step == 7 else states), losses   # member 0's last update

    run.programs.train_chunk = chunk
    record, _ = run.run()
    assert [b["diverged_at"] for b in record["budgets"]] == [[None, 4, None, None], [8, None, None, 4]]
    assert record["diverged_at"] == [8, None, None, 4]


def test_a_group_beyond_the_grid_joins_its_schemes_record_member_by_member():
    from roformer.study.groups import merge_groups

    def group(rates, offset):
        members = [{"index": offset + i, "seed": i % 2, "rate": r} for i, r in enumerate(rates)]
        n = len(members)
        evals = [{"step": step, "tokens": step * 10, "validation_loss": [offset + i + step for i in range(n)],
                  "validation_accuracy": [0.1] * n, "gaps": {"shuffle2": [offset + i for i in range(n)]},
                  "signal": {"scale": [[offset + i, 0.0] for i in range(n)]}} for step in (0, 10)]
        budgets_ = [{"steps": 10, "tokens": 100, "validation_loss": [offset + i for i in range(n)],
                     "test_loss": [offset + i for i in range(n)]}]
        record = {"scheme": "rope", "members": members, "evals": evals, "budgets": budgets_, "diverged_at": [None] * n,
                  "timing": {"wall_s": 1.0}, "fingerprint": "f"}
        return record, {"budget10": np.arange(offset, offset + n, dtype=np.float32)[:, None] * np.ones((1, 3))}

    main, main_arrays = group([1e-3, 1e-3, 2e-3, 2e-3], 0)
    extra, extra_arrays = group([5e-4, 5e-4], 4)
    main_arrays["test_weight"] = np.ones(3)
    # sums written ahead of a record that did not land: only the record's members are kept
    stale = {**main_arrays, "budget10": np.concatenate([main_arrays["budget10"], np.full((2, 3), -1.0)])}
    merged, arrays = merge_groups(main, stale, extra, extra_arrays)
    assert [m["index"] for m in merged["members"]] == [0, 1, 2, 3, 4, 5] and merged["fingerprint"] == "f"
    assert [e["validation_loss"] for e in merged["evals"]] == [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]]
    assert merged["evals"][1]["gaps"]["shuffle2"] == [0, 1, 2, 3, 4, 5]
    assert [row[0] for row in merged["evals"][0]["signal"]["scale"]] == [0, 1, 2, 3, 4, 5]
    assert merged["budgets"][0]["test_loss"] == [0, 1, 2, 3, 4, 5] and merged["diverged_at"] == [None] * 6
    np.testing.assert_array_equal(arrays["budget10"][:, 0], np.arange(6))
    np.testing.assert_array_equal(arrays["test_weight"], np.ones(3))
    from roformer.study.report import choose_rate
    assert sorted({m["rate"] for m in merged["members"]})[choose_rate(merged, merged["budgets"][0])] == 1e-3
    # Each budget's own divergences join too, where both records kept them; else neither counts.
    main["budgets"][0]["diverged_at"], extra["budgets"][0]["diverged_at"] = [None] * 4, [None, 7]
    merged, _ = merge_groups(main, main_arrays, extra, extra_arrays)
    assert merged["budgets"][0]["diverged_at"] == [None] * 5 + [7]
    assert sorted({m["rate"] for m in merged["members"]})[choose_rate(merged, merged["budgets"][0])] == 1e-3
    del extra["budgets"][0]["diverged_at"]
    assert "diverged_at" not in merge_groups(main, main_arrays, extra, extra_arrays)[0]["budgets"][0]


def test_a_group_whose_compiling_ahead_failed_is_compiled_in_its_turn(caplog):
    import threading

    from roformer.study.groups import CompileAhead

    class Prepared:
        compiled_ahead = False

    def prepare(scheme):
        if threading.current_thread().name.startswith("compile-ahead"):
            raise RuntimeError("no room for it now")
        return Prepared()

    ahead = CompileAhead(prepare, groups=1)
    ahead.submit("rope", "rope")
    with caplog.at_level("WARNING", logger="roformer.study"):
        run = ahead.take("rope", "rope")
    ahead.close()
    assert isinstance(run, Prepared) and not run.compiled_ahead
    assert "rope: compiling ahead failed; compiling here" in caplog.text and "no room for it now" in caplog.text
