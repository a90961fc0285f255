"""What the position-scheme study (roformer.study) trains, and whether it fits: the plan
built once from the config (`build_plan`: each scheme's pretraining config, the rates, budgets
and windows, the members of a scheme's group, rate x seed), its validation (every problem in
one error) and a group's memory estimate on the device.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import ml_collections
import numpy as np
from flax import nnx

from roformer.config_files import split_list
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.study import data as study_data, end_state
from roformer.study.preregistration import Preregistration
from roformer.train import optim
from roformer.train.config import arm_pretrain_config, build_model_config

# ALiBi's slopes for n heads are 2^(-8/n), 2^(-16/n), ...: below 4 heads no head has a slope
# of 1/4 or more, and none can prefer an adjacent token (docs/model.md).
ALIBI_MIN_HEADS = 4
EVAL_IN_FLIGHT = 4   # evaluation chunks dispatched before the first is read back


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Member:
    index: int
    seed: int
    rate: float


@dataclasses.dataclass(frozen=True, eq=False)
class StudyPlan:
    """What the study trains, derived once from its config (`build_plan`): every later stage
    (validation, the memory check, fingerprints, the groups, the report's order) reads it."""
    config: ml_collections.ConfigDict   # as given: recorded with the records; its study.* scalars
    schemes: tuple[str, ...]
    rates: tuple[float, ...]
    budgets: tuple[int, ...]            # ascending: each a budget's end
    windows: tuple[int, ...]
    pretrain: dict                      # scheme -> the pretraining config its group trains
    preregistration: Preregistration | None = None   # None: it could not be read (a problem)
    problems: tuple[str, ...] = ()      # settings that could not be read (validate reports them)
    models: dict = dataclasses.field(default_factory=dict)   # scheme -> its model, at a placeholder vocabulary

    @property
    def study(self) -> ml_collections.ConfigDict:
        return self.config.study

    @property
    def train(self) -> ml_collections.ConfigDict:
        """The train section every scheme shares (batch, length, optimizer settings)."""
        return self.config.pretrain.train

    def model_config(self, scheme: str, vocab_size: int = ModelConfig.vocab_size, pad_token_id: int = 0
                     ) -> ModelConfig:
        """The scheme's model (`models`) at the data's vocabulary."""
        return dataclasses.replace(self.models[scheme], vocab_size=vocab_size, pad_token_id=pad_token_id)

    def members(self, rates_: list[float] | None = None, first_index: int = 0) -> list[Member]:
        """Every (rate, seed) of a scheme's group, rate-major: member first_index + r * seeds + s.
        `rates_`: the study's rates (default) or those of a group trained beside them."""
        seeds, grid = int(self.study.seeds), list(self.rates) if rates_ is None else rates_
        return [Member(first_index + r * seeds + s, s, rate) for r, rate in enumerate(grid) for s in range(seeds)]


def pretrain_steps(config) -> int:
    """The pretraining section's step count as the scheme's configs record it (a config recorded
    before the study had a config file of its own gives it as budget_tokens)."""
    train = config.pretrain.train
    if config.get("budget_tokens", 0) > 0:
        return math.ceil(config.budget_tokens / (train.batch_size * train.seq_len))
    return int(train.steps)


def build_plan(config) -> StudyPlan:
    """The plan of `config`. A setting that cannot be read is left out and named in the plan's
    `problems`, so `validate` reports it with every other problem in one error."""
    st, problems = config.study, []

    def parsed(key: str, kind, rule: str) -> tuple:
        try:
            return tuple(kind(item) for item in split_list(st[key]))
        except ValueError:
            problems.append(f"study.{key}={st[key]!r}: {rule}")
            return ()

    schemes = tuple(split_list(st.schemes))
    pretrain, models = {}, {}
    for scheme in schemes:   # the one place a scheme's pretraining and model config are derived
        try:
            pretrain[scheme] = arm_pretrain_config(config.pretrain, scheme, steps=pretrain_steps(config))
            models[scheme] = build_model_config(pretrain[scheme].model, vocab_size=ModelConfig.vocab_size)
        except ValueError as error:
            pretrain.pop(scheme, None)
            problems.append(f"scheme {scheme!r}: {error}")
    rates = parsed("learning_rates", float, "a comma list of distinct rates, each > 0")
    budgets = tuple(sorted(parsed("budget_steps", int, f"distinct positive multiples of study.eval_every={st.eval_every}")))
    windows = parsed("windows", int, "a comma list of window lengths >= 2")
    try:
        preregistration = Preregistration.from_config(st)
    except ConfigError as error:
        preregistration = None
        problems.append(str(error))
    return StudyPlan(config, schemes, rates, budgets, windows, pretrain, preregistration, tuple(problems), models)


def validate(plan: StudyPlan) -> None:
    """Every setting the study depends on, before anything is read or trained: one ConfigError
    naming every problem."""
    st, problems = plan.study, list(plan.problems)
    schemes = list(plan.schemes)
    if not schemes or len(set(schemes)) != len(schemes):
        problems.append(f"study.schemes={st.schemes!r}: list each scheme once")
    if st.reference not in schemes:
        problems.append(f"study.reference={st.reference!r} is not one of study.schemes {schemes}")
    for scheme, model in plan.models.items():
        if model.position == "alibi" and model.num_heads < ALIBI_MIN_HEADS:
            problems.append(f"scheme {scheme!r}: ALiBi with {model.num_heads} heads has no slope >= 1/4 (no head can "
                            f"prefer an adjacent token); give the model >= {ALIBI_MIN_HEADS} heads "
                            "(pretrain.model.num_heads)")
    values = plan.rates
    if "learning_rates" not in " ".join(plan.problems) and (
            not values or any(not math.isfinite(r) or r <= 0 for r in values) or len(set(values)) != len(values)):
        problems.append(f"study.learning_rates={st.learning_rates!r}: a comma list of distinct rates, each > 0")
    if not (isinstance(st.compile_ahead, int) and not isinstance(st.compile_ahead, bool) and st.compile_ahead >= 0):
        problems.append(f"study.compile_ahead={st.compile_ahead!r}: the number of groups compiled ahead (>= 0; 0: "
                        "each in its turn)")
    if not (isinstance(st.seeds, int) and st.seeds >= 1):
        problems.append(f"study.seeds={st.seeds!r}: give the number of seeds per rate (>= 1)")
    if plan.preregistration is not None and isinstance(st.seeds, int):
        outside = sorted(s for s in plan.preregistration.tuning_seeds + plan.preregistration.scored_seeds
                         if not 0 <= s < st.seeds)
        if outside:
            problems.append(f"pre-registration: seeds {outside} are not among the study's seeds 0..{st.seeds - 1} "
                            "(study.tuning_seeds, study.scored_seeds, study.seeds)")
    if not 0 < st.cooldown_fraction <= 1:
        problems.append(f"study.cooldown_fraction={st.cooldown_fraction!r}: must be in (0, 1]")
    ends = plan.budgets
    if "budget_steps" not in " ".join(plan.problems):
        if not ends or ends[0] <= 0 or any(b % st.eval_every for b in ends) or len(set(ends)) != len(ends):
            problems.append(f"study.budget_steps={st.budget_steps!r}: distinct positive multiples of "
                            f"study.eval_every={st.eval_every}")
        elif 0 < st.cooldown_fraction <= 1:
            starts = [start for start, _ in optim.cooldown_branches(list(ends), st.cooldown_fraction)]
            if any(s % st.eval_every for s in starts) or starts[0] < st.warmup_steps:
                problems.append(f"study.budget_steps={st.budget_steps!r}: each budget's cooldown start "
                                f"({starts}) must be a multiple of study.eval_every={st.eval_every} and come after "
                                f"study.warmup_steps={st.warmup_steps}")
        if ends and ends[0] > 0:
            try:
                end_state.check_flat_window([b * plan.train.batch_size * plan.train.seq_len for b in ends])
            except ConfigError as error:
                problems.append(f"study.budget_steps={st.budget_steps!r}: {error}")
    if "windows" not in " ".join(plan.problems) and (not plan.windows or any(w < 2 for w in plan.windows)):
        problems.append(f"study.windows={st.windows!r}: a comma list of window lengths >= 2")
    for key in ("validation_rows", "variant_rows", "test_mask_draws", "eval_batch", "bootstrap"):
        if not (isinstance(st[key], int) and st[key] >= 1):
            problems.append(f"study.{key}={st[key]!r}: must be a whole number >= 1")
    if isinstance(st.variant_rows, int) and isinstance(st.validation_rows, int) and st.variant_rows > st.validation_rows:
        problems.append(f"study.variant_rows={st.variant_rows} must not exceed study.validation_rows={st.validation_rows}")
    if not isinstance(st.extend_edges, bool):
        problems.append(f"study.extend_edges={st.extend_edges!r}: true or false")
    if st.memory_limit_gib < 0:
        problems.append(f"study.memory_limit_gib={st.memory_limit_gib!r}: must be >= 0 (0: the device's)")
    if problems:
        raise ConfigError("study config: " + "; ".join(problems))


def edge_rates(trained: list[float], chosen: list[int]) -> list[float]:
    """study.extend_edges: one geometric step beyond each end of the `trained` rates (sorted)
    at which some budget chose the end rate (`chosen`: the index chosen at each budget). With
    them the grid brackets that budget's optimum, or the report says it still does not."""
    if len(trained) < 2:
        return []
    low, high = trained[0] * trained[0] / trained[1], trained[-1] * trained[-1] / trained[-2]
    return [rate for end, rate in ((0, low), (len(trained) - 1, high)) if end in chosen]


# --------------------------------------------------------------------------- memory


def parameter_count(model_cfg: ModelConfig) -> int:
    shapes = nnx.eval_shape(lambda: RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))


def memory_estimate(model_cfg: ModelConfig, *, members_: int, batch_size: int, seq_len: int,
                    max_predictions: int, data_bytes: int, eval_batch: int = 0) -> int:
    """Bytes a group needs on the device, estimated before compiling: per member the float32
    parameters, Adam's two moments, the gradients and the branch's copy of all three (8 x
    parameters), the activations kept for the backward pass (Korthikanti et al. 2022's
    per-layer sbh(34 + 5as/h), doubled for float32) and the MLM head's logits with their
    softmax and gradient; the evaluation's logits and softmax for `eval_batch` rows of every
    member, `EVAL_IN_FLIGHT` chunks at once; and the data held on the device."""
    params = parameter_count(model_cfg)
    s, b, h, a = seq_len, batch_size, model_cfg.hidden_size, model_cfg.num_heads
    per_layer = s * b * h * (34 + 5 * a * s / h) * 2
    logits = max_predictions * model_cfg.vocab_size * 4
    per_member = 8 * params * 4 + model_cfg.num_layers * per_layer + 3 * b * logits
    evaluation = EVAL_IN_FLIGHT * 2 * eval_batch * logits
    return int(members_ * (per_member + evaluation) + data_bytes)


def initial_state_bytes(model_cfg: ModelConfig, members_: int) -> int:
    """A group's initial states: per member the float32 parameters and Adam's two moments. A
    group prepared ahead (study.compile_ahead) holds them on the device while another trains."""
    return 3 * 4 * parameter_count(model_cfg) * members_


def device_memory_bytes(limit_gib: float = 0.0) -> int:
    """`limit_gib` when > 0, else what the first device may allocate (the host's available
    memory on a CPU backend)."""
    if limit_gib > 0:
        return int(limit_gib * 2**30)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else 2**40


def _gib(size: int) -> str:
    """GiB to 3 significant figures, so a small group and limit do not both read 0.0."""
    return f"{size / 2**30:.3g}"


def check_memory(plan: StudyPlan, data: study_data.StudyData) -> dict[str, int]:
    """Each scheme's estimate while its group trains, with the initial states of the
    `study.compile_ahead` groups prepared meanwhile (the largest scheme's, each); ConfigError
    (one line) when one exceeds 90% of the device's."""
    train = plan.train
    data_bytes = sum(v.nbytes for v in data.train.values()) + 4 * plan.study.seeds * data.train["input_ids"].shape[0] * \
        study_data.passes_needed(plan.budgets[-1], train.batch_size, data.train["input_ids"].shape[0])
    available = device_memory_bytes(plan.study.memory_limit_gib)
    n, ahead = len(plan.members()), int(plan.study.compile_ahead)
    estimates, states = {}, {}
    for scheme in plan.schemes:
        model_cfg = plan.model_config(scheme, data.vocab_size, data.pad_id)
        estimates[scheme] = memory_estimate(model_cfg, members_=n, batch_size=train.batch_size,
                                            seq_len=train.seq_len, max_predictions=data.max_predictions,
                                            data_bytes=data_bytes, eval_batch=int(plan.study.eval_batch))
        states[scheme] = initial_state_bytes(model_cfg, n)
    estimates = {scheme: size + ahead * max(states.values()) for scheme, size in estimates.items()}
    worst = max(estimates, key=estimates.get)
    if estimates[worst] > 0.9 * available:
        waiting = f", with {ahead} group(s) prepared ahead (study.compile_ahead)" if ahead else ""
        raise ConfigError(f"the {n}-member group of {worst!r} needs about {_gib(estimates[worst])} GiB{waiting}, "
                          f"more than 90% of the device's {_gib(available)} GiB: fewer study.seeds or "
                          "learning_rates, a smaller batch or a lower study.compile_ahead")
    return estimates
