"""Vmapped seeds at learning rates of their own (roformer.train.seeds): one compiled group
trains rates x seeds, each member as the run alone at its rate."""
import pytest

from roformer.errors import ConfigError
from roformer.train import train_and_evaluate
from roformer.train.seeds import check_seed_group, train_seeds_and_evaluate

from helpers.train import losses_match, rows, seed_configs

MEMBERS = ((0, 1e-3), (1, 3e-3))   # (seed, learning rate)


def member_configs(cache):
    return [seed_configs(cache, seeds=(seed,), **{"train.learning_rate": rate})[0] for seed, rate in MEMBERS]


@pytest.mark.slow   # three short trainings: about a minute on a loaded 2-core CPU
def test_members_at_their_own_rates_train_as_each_run_alone(tmp_path_factory):
    cache = tmp_path_factory.mktemp("rates_cache")
    alone, together = tmp_path_factory.mktemp("alone"), tmp_path_factory.mktemp("together")
    for config in member_configs(cache):
        train_and_evaluate(config, alone / f"seed{config.train.seed}")
    results = train_seeds_and_evaluate(member_configs(cache), [together / f"seed{s}" for s, _ in MEMBERS])
    for (seed, _), result in zip(MEMBERS, results):
        assert result["final_step"] == 8 and result["seeds_in_step"] == 2
        losses_match(rows(together / f"seed{seed}"), rows(alone / f"seed{seed}"))
    # A member's checkpoints hold its rate in the optimizer state: a run alone refuses them
    # in one line and leaves them where they are (it once moved them aside as corrupt and
    # trained again from step 0).
    config = member_configs(cache)[1]
    config.train.steps = 10
    member = together / f"seed{MEMBERS[1][0]}"
    before = sorted(p.name for p in (member / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match="holds a train state of another structure than this run's"):
        train_and_evaluate(config, member)
    assert sorted(p.name for p in (member / "checkpoints").iterdir()) == before
    assert not (member / "corrupt_checkpoints").exists()


def test_a_group_may_differ_in_rate_but_not_in_other_settings(tmp_path):
    configs = member_configs(tmp_path)
    check_seed_group(configs)
    configs[1].train.warmup_steps += 1
    with pytest.raises(ConfigError, match="every setting but train.seed and train.learning_rate"):
        check_seed_group(configs)
