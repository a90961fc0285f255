"""The study's plan (roformer/study/plan.py): configs/study.py's variants, the settings it
refuses before anything trains, the memory estimate, and the rates beyond a grid."""
import pytest

from helpers.study import config
from roformer import config_files as plan
from roformer.errors import ConfigError
from roformer.study import plan as study_plan
from roformer.study import session as study


@pytest.mark.parametrize("variant", ["gpu_tiny", "gpu_tiny_long", "gpu_mini", "gpu_small", "gpu_smoke"])
def test_every_variant_is_valid_and_alibi_has_at_least_four_heads(variant):
    c = config(variant)
    study_plan.validate(study_plan.build_plan(c))
    if "alibi" in plan.split_list(c.study.schemes):
        assert study_plan.build_plan(c).model_config("alibi").num_heads >= 4
    assert len(study_plan.build_plan(c).members()) == c.study.seeds * len(study_plan.build_plan(c).rates)


def test_the_accelerator_variants_train_every_scheme_8_seeds_x_3_rates():
    for variant in ("gpu_tiny", "gpu_tiny_long", "gpu_mini", "gpu_small"):
        c = config(variant)
        assert set(plan.split_list(c.study.schemes)) == {"rope", "learned", "shaw", "t5", "alibi", "sinusoidal", "none"}
        assert c.study.seeds >= 8 and len(study_plan.build_plan(c).rates) == 3 and c.study.min_test_predictions >= 200_000
    mini = study_plan.build_plan(config("gpu_mini")).model_config("rope")
    assert (mini.num_layers, mini.hidden_size, mini.num_heads) == (4, 256, 4)


@pytest.mark.parametrize("keys, message", [
    ({"equivalence_margin": 0.0}, "equivalence_margin=0.0"), ({"equivalence_reason": " "}, "equivalence_reason"),
    ({"tuning_seeds": "0,1"}, r"seeds \[1\] both tune and are scored"),
    ({"scored_seeds": "1,2"}, r"seeds \[2\] are not among the study's seeds 0..1"),
    ({"budget_steps": "10,20"}, "the flat test needs >= 2 budgets"),
    ({"learning_rates": "1e-3,0"}, "study.learning_rates"), ({"learning_rates": "1e-3,-2e-3"}, "study.learning_rates"),
    ({"schemes": "rope,nope"}, "unknown scheme 'nope'"), ({"reference": "learned"}, "study.reference"),
    ({"budget_steps": "10,15"}, "study.budget_steps"), ({"windows": "1,4"}, "study.windows"),
    ({"compile_ahead": -1}, "study.compile_ahead=-1")])
def test_bad_settings_are_one_line_before_anything_trains(keys, message):
    with pytest.raises(ConfigError, match=message) as error:
        study_plan.validate(study_plan.build_plan(config(**keys)))
    assert "\n" not in str(error.value)


def test_alibi_with_two_heads_is_refused():
    c = config()
    c.pretrain.model.num_heads = 2
    with pytest.raises(ConfigError, match="ALiBi with 2 heads"):
        study_plan.validate(study_plan.build_plan(c))


def test_an_unknown_variant_is_one_line():
    with pytest.raises(ConfigError, match="unknown configs/study.py variant 'gpu_huge'.*'gpu_tiny'"):
        config("gpu_huge")


def test_the_memory_estimate_refuses_a_group_that_does_not_fit():
    c = config(memory_limit_gib=0.001)
    data = study.study_splits(study_plan.build_plan(c))
    with pytest.raises(ConfigError, match=r"group of 'rope' needs about .* GiB, with 1 group\(s\) prepared ahead "
                       r"\(study.compile_ahead\), more than 90% of the device's") as error:
        study_plan.check_memory(study_plan.build_plan(c), data)
    assert "\n" not in str(error.value) and "0.0 GiB" not in str(error.value)   # small sizes still read
    c.study.memory_limit_gib = 64.0
    assert set(study_plan.check_memory(study_plan.build_plan(c), data)) == set(plan.split_list(c.study.schemes))


def test_the_memory_estimate_counts_the_initial_states_of_the_groups_prepared_ahead():
    """Each group prepared ahead holds its members' parameters and Adam moments on the device
    while another trains: the estimate adds compile_ahead times the largest scheme's."""
    c = config(memory_limit_gib=64.0, compile_ahead=0)
    data = study.study_splits(study_plan.build_plan(c))
    alone = study_plan.check_memory(study_plan.build_plan(c), data)
    c.study.compile_ahead = 2
    ahead = study_plan.check_memory(study_plan.build_plan(c), data)
    n = len(study_plan.build_plan(c).members())
    largest = max(study_plan.initial_state_bytes(study_plan.build_plan(c).model_config(s, data.vocab_size, data.pad_id), n)
                  for s in plan.split_list(c.study.schemes))
    assert largest > 0 and {s: ahead[s] - alone[s] for s in alone} == {s: 2 * largest for s in alone}


def test_memory_estimate_grows_with_members_and_width():
    base = study_plan.build_plan(config("gpu_tiny")).model_config("rope")
    mini = study_plan.build_plan(config("gpu_mini")).model_config("rope")
    est = lambda m, n: study_plan.memory_estimate(m, members_=n, batch_size=16, seq_len=128, max_predictions=20,  # noqa: E731
                                             data_bytes=0)
    assert est(base, 24) == 2 * est(base, 12) and est(mini, 24) > est(base, 24)


def test_rates_beyond_the_grid_continue_it_geometrically_at_each_chosen_edge():
    grid = [7e-4, 1.4e-3, 2.8e-3]
    assert study_plan.edge_rates(grid, [1, 1, 1]) == []
    assert study_plan.edge_rates(grid, [2, 1, 0]) == pytest.approx([3.5e-4, 5.6e-3])
    assert study_plan.edge_rates(grid, [1, 2]) == pytest.approx([5.6e-3])
    assert study_plan.edge_rates([1e-3], [0]) == []
    c = config()
    extra = study_plan.build_plan(c).members([3.5e-4], first_index=4)
    assert [(m.index, m.seed, m.rate) for m in extra] == [(4, 0, 3.5e-4), (5, 1, 3.5e-4)]
