"""What an ablation runs (roformer.ablation.plan): per-scheme configs, per-scheme
exceptions, validation and fingerprints."""
import pytest

from roformer.ablation import plan, validation

from helpers.ablation import small_config

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_schemes_share_everything_but_the_model_position():
    config = small_config("learned,sinusoidal,shaw,t5,rope,rope_linear", seeds=3)
    the_plan = plan.build_plan(config, "/ablation")
    cfgs = the_plan.scheme_configs
    expected_steps = -(-config.budget_tokens // (config.pretrain.train.batch_size * config.pretrain.train.seq_len))
    for scheme, cfg in cfgs.items():
        assert cfg.data.to_dict() == config.pretrain.data.to_dict()
        assert cfg.train.steps == expected_steps
        assert cfg.train.seed == 0
        assert {k: v for k, v in cfg.train.items() if k not in ("steps", "seed")} == \
            {k: v for k, v in config.pretrain.train.items() if k not in ("steps", "seed")}
        assert cfg.model.size == "tiny"
        assert cfg.model.max_position_embeddings == cfg.train.seq_len
        # Its run of seed 0 trains the scheme's config; another pretraining seed changes the seed and nothing else.
        assert the_plan.run(f"{scheme}/seed0").train_config.to_dict() == cfg.to_dict()
        other = the_plan.run(f"{scheme}/seed2").train_config
        assert other.train.seed == 2
        other = other.to_dict()
        other["train"]["seed"] = 0
        assert other == cfg.to_dict()
    positions = {s: c.model.position for s, c in cfgs.items()}
    assert positions == {"learned": "learned", "sinusoidal": "sinusoidal", "shaw": "shaw", "t5": "t5",
                         "rope": "rope", "rope_linear": "rope"}
    assert cfgs["rope_linear"].model.attention == "linear" and cfgs["rope"].model.attention == "softmax"
    unknown = plan.build_plan(small_config("learned,rotery"), "/ablation")
    assert any("unknown scheme 'rotery'" in problem for problem in unknown.problems)
    assert unknown.runs == () and set(unknown.scheme_configs) == {"learned"}
    with pytest.raises(ValueError, match="unknown scheme 'rotery'"):
        validation.validate(unknown)


def test_a_schemes_model_keys_are_the_librarys_and_its_config_file_sets_the_same():
    """The library names what an arm changes (it loads no config file to learn it); each arm's
    config file, the user's way to pretrain it alone, changes those keys of configs/base.py."""
    import importlib

    from roformer.configs import SCHEME_FILES
    from roformer.train.config import ARM_ALIASES, arm_model_keys

    base = importlib.import_module("roformer.configs.base").get_config().model.to_dict()
    for arm, file in SCHEME_FILES.items():
        model = importlib.import_module(f"roformer.configs.{file}").get_config().model.to_dict()
        changed = {k: v for k, v in model.items() if base.get(k) != v}
        keys = arm_model_keys(arm)
        assert {k: v for k, v in keys.items() if base.get(k) != v} == changed, arm
        assert {k: model[k] for k in keys} == keys, arm
        assert arm_model_keys(file) == keys   # the file's name names the arm too
    assert set(ARM_ALIASES) <= set(SCHEME_FILES.values())


def test_scheme_seeds_and_learning_rates_are_per_scheme_exceptions():
    config = small_config("learned,rope,none", seeds=2)
    config.scheme_seeds = "rope=3,none=1"
    config.scheme_learning_rates = "learned=1e-3"
    the_plan = plan.build_plan(config, "/ablation")
    validation.validate(the_plan)
    # Every scheme of seed 0 first, then seed 1 of the schemes that have it, ...
    assert [(r.key, r.seed) for r in the_plan.scheme_runs] == [("learned", 0), ("rope", 0), ("none", 0), ("learned", 1),
                                                                ("rope", 1), ("rope", 2)]
    assert the_plan.scheme_configs["learned"].train.learning_rate == 1e-3
    assert the_plan.run("learned/seed1").train_config.train.learning_rate == 1e-3
    assert the_plan.scheme_configs["rope"].train.learning_rate == config.pretrain.train.learning_rate


@pytest.mark.parametrize("key, value, message", [
    ("scheme_seeds", "rope:3", r"config.scheme_seeds: item 'rope:3' is not scheme=int"),
    ("scheme_seeds", "t5=2", r"config.scheme_seeds names \['t5'\], not in config.schemes"),
    ("scheme_learning_rates", "rope=fast", r"item 'rope=fast' is not scheme=float"),
    ("scheme_learning_rates", "rope=0", r"config.scheme_learning_rates='rope=0': every value must be > 0"),
])
def test_per_scheme_settings_are_checked_before_any_training(key, value, message):
    config = small_config()
    config[key] = value
    with pytest.raises(ValueError, match=message):
        validation.validate(plan.build_plan(config, "/ablation"))


def test_fingerprint_ignores_settings_that_only_watch_a_run():
    cfg = plan.build_plan(small_config(), "/ablation").scheme_configs["rope"]
    fp = plan.fingerprint(cfg)
    cfg.train.progress_bar = not cfg.train.progress_bar
    cfg.train.divergence_factor = 3.0
    cfg.train.profile_steps = "2:3"
    assert plan.fingerprint(cfg) == fp
    cfg.train.learning_rate *= 2
    assert plan.fingerprint(cfg) != fp


@pytest.mark.parametrize("variant", [None, "smoke", "reference", "onset"])
def test_every_ablation_variant_is_a_valid_config(variant):
    the_plan = plan.build_plan(plan.load_config_file("ablation", variant), "/ablation")
    validation.validate(the_plan)
    if variant == "onset":   # 10x the reference's budget, more seeds where onsets vary most
        assert the_plan.steps == 20_000
        assert [the_plan.seeds[s] for s in ("rope", "learned", "none", "shaw")] == [5, 5, 5, 3]


def test_list_settings_take_comma_lists_from_the_command_line_and_give_the_same_fingerprints():
    from absl import flags
    from ml_collections import config_flags

    argv = ["ablate", f"--config={plan.CONFIG_DIR / 'ablation.py'}:smoke", "--config.schemes=rope,learned",
            "--config.stages=pretrain,extrapolation", "--config.extrapolation.factors=1,2",
            "--config.extrapolation.scalings=", "--config.extension.methods=none",
            "--config.extension.methods=linear"]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "ablation config", flag_values=values, sys_argv=argv)
    values(argv)
    config = values.config
    the_plan = plan.build_plan(config, "/ablation")
    validation.validate(the_plan)
    assert (the_plan.schemes, the_plan.factors, the_plan.scalings, the_plan.extension_methods) == (
        ("rope", "learned"), (1, 2), (), ("none", "linear"))
    assert the_plan.glue_tasks == ()
    assert [[s.name for s in r.stages] for r in the_plan.runs[:2]] == [["pretrain", "extrapolation"]] * 2

    # A list written as a comma string (an older workdir's config) plans the same stages.
    as_text = plan.load_config_file("ablation", "smoke")
    for section, key in (("extrapolation", "factors"), ("extrapolation", "scalings"), ("extension", "methods")):
        with as_text[section].ignore_type():
            as_text[section][key] = ",".join(map(str, as_text[section][key]))
    with as_text.ignore_type():
        as_text.schemes = "learned,rope"
    fingerprints = [[(s.name, s.fingerprint) for s in r.stages]
                    for r in plan.build_plan(plan.load_config_file("ablation", "smoke"), "/ablation").runs]
    assert fingerprints == [[(s.name, s.fingerprint) for s in r.stages] for r in plan.build_plan(as_text, "/ablation").runs]


@pytest.mark.parametrize("stages", [("extrapolation", "pretrain"), ("pretrain", "glue", "glue"), ("pretrain", "extension")])
def test_stages_start_with_pretraining_and_name_each_scheme_stage_once(stages):
    config = small_config()
    config.stages = stages
    with pytest.raises(ValueError, match=r"config.stages=.*: pretrain, then any of extrapolation, glue, each once"):
        validation.validate(plan.build_plan(config, "/ablation"))


def test_every_stage_the_plan_names_has_a_runner_and_belongs_to_one_kind_of_run():
    from roformer.ablation import stages

    assert set(stages.STAGE_RUNNERS) == set(plan.STAGES)
    assert {plan.STAGES[name].run_kind for name in plan.SCHEME_STAGES} == {"scheme"}
    assert {plan.STAGES[name].run_kind for name in plan.EXTENSION_STAGES} == {"extension"}
