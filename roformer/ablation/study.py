"""The position-scheme comparison sized for one accelerator call (`configs/ablation.py:gpu_*`).

Per scheme, one compiled program trains every member at once: `study.seeds` seeds x
`study.learning_rates` rates, stacked on a leading axis and vmapped, each member with its
own initialisation and data order (its seed: every rate of a seed starts alike and sees the
same batches) and its own learning rate (an optimizer-state hyperparameter,
roformer.train.optim.make_member_optimizer). The schedule is warmup-stable-decay: the trunk
trains at the peak rate, and at each budget's cooldown start its state is copied and decayed
to 0 (a branch), so one run gives the end-of-schedule loss of every budget. The data live on
the device (roformer.ablation.study_data), so no host work paces a step.

Evaluated at every `eval_every` steps of the trunk: validation loss, the order-horizon
spectrum (loss increase under shuffles within windows and under reversal) and each scheme's
position signal; at every budget's end: validation loss (which chooses the rate) and the
test loss of every test row (which the report's seed x item bootstrap resamples). A member
whose loss stops being finite, or climbs above where it started, is recorded as diverged.

Resumable by scheme: a scheme whose record (DIR/schemes/<scheme>.json) has the config's
fingerprint is not trained again; the report (roformer.ablation.study_report) is rewritten
after every scheme.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from roformer.ablation import plan, study_data, study_stats
from roformer.data import DataConfig
from roformer.errors import ConfigError
from roformer.files import write_bytes_atomic, write_json_atomic, write_text_atomic
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train import optim, steps
from roformer.train.loop import build_model_config

log = logging.getLogger("roformer.ablate")

SCHEMES_DIR = "schemes"
CONFIG_RECORD = "study_config.json"
# ALiBi's slopes for n heads are 2^(-8/n), 2^(-16/n), ...: below 4 heads no head has a slope
# of 1/4 or more, and none can prefer an adjacent token (docs/model.md).
ALIBI_MIN_HEADS = 4
EVAL_IN_FLIGHT = 4   # evaluation chunks dispatched before the first is read back


# --------------------------------------------------------------------------- the config


def rates(config) -> list[float]:
    return [float(r) for r in plan.split_list(config.study.learning_rates)]


def budgets(config) -> list[int]:
    return sorted(int(b) for b in plan.split_list(config.study.budget_steps))


def windows(config) -> list[int]:
    return [int(w) for w in plan.split_list(config.study.windows)]


def scheme_model_config(config, scheme: str, vocab_size: int = 8000, pad_token_id: int = 0) -> ModelConfig:
    """The scheme's model: config.pretrain's model section with the scheme's config-file keys."""
    cfg = plan.scheme_pretrain_config(config, scheme)
    return build_model_config(cfg.model, vocab_size=vocab_size, pad_token_id=pad_token_id)


def validate(config) -> None:
    """Every setting the study depends on, before anything is read or trained: one ConfigError
    naming every problem."""
    st, problems = config.study, []
    schemes = plan.split_list(st.schemes)
    if not schemes or len(set(schemes)) != len(schemes):
        problems.append(f"study.schemes={st.schemes!r}: list each scheme once")
    if st.reference not in schemes:
        problems.append(f"study.reference={st.reference!r} is not one of study.schemes {schemes}")
    for scheme in schemes:
        try:
            model = scheme_model_config(config, scheme)
        except ValueError as error:
            problems.append(f"scheme {scheme!r}: {error}")
            continue
        if model.position == "alibi" and model.num_heads < ALIBI_MIN_HEADS:
            problems.append(f"scheme {scheme!r}: ALiBi with {model.num_heads} heads has no slope >= 1/4 (no head can "
                            f"prefer an adjacent token); give the model >= {ALIBI_MIN_HEADS} heads "
                            "(pretrain.model.num_heads)")
    try:
        values = rates(config)
        if not values or any(not math.isfinite(r) or r <= 0 for r in values) or len(set(values)) != len(values):
            raise ValueError
    except ValueError:
        problems.append(f"study.learning_rates={st.learning_rates!r}: a comma list of distinct rates, each > 0")
    if not (isinstance(st.seeds, int) and st.seeds >= 1):
        problems.append(f"study.seeds={st.seeds!r}: give the number of seeds per rate (>= 1)")
    if not (isinstance(st.margin, (int, float)) and math.isfinite(st.margin) and st.margin > 0):
        problems.append(f"study.margin={st.margin!r}: the equivalence margin in nats must be > 0")
    if not 0 < st.cooldown_fraction <= 1:
        problems.append(f"study.cooldown_fraction={st.cooldown_fraction!r}: must be in (0, 1]")
    try:
        ends = budgets(config)
        if not ends or ends[0] <= 0 or any(b % st.eval_every for b in ends) or len(set(ends)) != len(ends):
            raise ValueError
        starts = [start for start, _ in optim.cooldown_branches(ends, st.cooldown_fraction)]
        if any(s % st.eval_every for s in starts) or starts[0] < st.warmup_steps:
            problems.append(f"study.budget_steps={st.budget_steps!r}: each budget's cooldown start "
                            f"({starts}) must be a multiple of study.eval_every={st.eval_every} and come after "
                            f"study.warmup_steps={st.warmup_steps}")
    except ValueError:
        problems.append(f"study.budget_steps={st.budget_steps!r}: distinct positive multiples of "
                        f"study.eval_every={st.eval_every}")
    try:
        ws = windows(config)
        if not ws or any(w < 2 for w in ws):
            raise ValueError
    except ValueError:
        problems.append(f"study.windows={st.windows!r}: a comma list of window lengths >= 2")
    for key in ("validation_rows", "variant_rows", "test_mask_draws", "eval_batch", "bootstrap"):
        if not (isinstance(st[key], int) and st[key] >= 1):
            problems.append(f"study.{key}={st[key]!r}: must be a whole number >= 1")
    if isinstance(st.variant_rows, int) and isinstance(st.validation_rows, int) and st.variant_rows > st.validation_rows:
        problems.append(f"study.variant_rows={st.variant_rows} must not exceed study.validation_rows={st.validation_rows}")
    if st.memory_limit_gib < 0:
        problems.append(f"study.memory_limit_gib={st.memory_limit_gib!r}: must be >= 0 (0: the device's)")
    if problems:
        raise ConfigError("study config: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Member:
    index: int
    seed: int
    rate: float


def members(config) -> list[Member]:
    """Every (rate, seed) of a scheme's group, rate-major: member r * seeds + s."""
    seeds = int(config.study.seeds)
    return [Member(r * seeds + s, s, rate) for r, rate in enumerate(rates(config)) for s in range(seeds)]


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


def check_memory(config, data: study_data.StudyData) -> dict[str, int]:
    """Each scheme's estimate; ConfigError (one line) when one exceeds 90% of the device's."""
    train = config.pretrain.train
    data_bytes = sum(v.nbytes for v in data.train.values()) + 4 * config.study.seeds * data.train["input_ids"].shape[0] * \
        study_data.passes_needed(budgets(config)[-1], train.batch_size, data.train["input_ids"].shape[0])
    available = device_memory_bytes(config.study.memory_limit_gib)
    estimates = {}
    for scheme in plan.split_list(config.study.schemes):
        model_cfg = scheme_model_config(config, scheme, data.vocab_size, data.pad_id)
        estimates[scheme] = memory_estimate(model_cfg, members_=len(members(config)), batch_size=train.batch_size,
                                            seq_len=train.seq_len, max_predictions=data.max_predictions,
                                            data_bytes=data_bytes, eval_batch=int(config.study.eval_batch))
    worst = max(estimates, key=estimates.get)
    if estimates[worst] > 0.9 * available:
        raise ConfigError(f"the {len(members(config))}-member group of {worst!r} needs about "
                          f"{estimates[worst] / 2**30:.1f} GiB, more than 90% of the device's "
                          f"{available / 2**30:.1f} GiB: fewer study.seeds or learning_rates, or a smaller batch")
    return estimates


# --------------------------------------------------------------------------- the programs


def row_sums(model, batch) -> dict[str, jax.Array]:
    """Per row: summed MLM loss, correct predictions and predictions (steps.mlm_sums by row)."""
    logits = model(batch["input_ids"], token_type_ids=batch["token_type_ids"], positions=batch["positions"],
                   segment_ids=batch["segment_ids"], masked_positions=batch["masked_positions"]).astype(jnp.float32)
    labels, weights = batch["masked_labels"], batch["masked_weights"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    correct = (label_logits >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return {"loss": jnp.sum(losses * weights, -1), "correct": jnp.sum(correct * weights, -1)}


class Programs:
    """The compiled programs of one scheme's group."""

    def __init__(self, model_cfg: ModelConfig, config, data: study_data.StudyData):
        st, train = config.study, config.pretrain.train
        self.tx = optim.make_member_optimizer(weight_decay=train.weight_decay, b1=train.b1, b2=train.b2,
                                              eps=train.eps, clip_norm=train.clip_norm)
        abstract = nnx.eval_shape(lambda: RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(0)))
        self.graphdef = nnx.split(abstract, nnx.Param, ...)[0]
        self.rest = nnx.split(RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)[2]
        keyed = steps.make_keyed_train_step(self.graphdef, self.tx, lambda _: 0.0)
        batch_size, chunk, warmup = int(train.batch_size), int(st.eval_every), int(st.warmup_steps)
        masking = dict(batch_size=batch_size, mask_id=data.mask_id, mask_rate=data.mask_rate,
                       max_predictions=data.max_predictions)

        def member_step(state, aux, rest, member, decay_start, decay_end):
            step = state["step"]
            batch = study_data.device_batch(aux["train"], aux["orders"], member["seed_index"], member["data_key"], step,
                                            special=aux["special"], replacement_ids=aux["replacement_ids"], **masking)
            factor = optim.wsd_factor(step, warmup_steps=warmup, decay_start=decay_start, decay_end=decay_end)
            state = {**state, "opt_state": optim.with_learning_rate(state["opt_state"], member["rate"] * factor)}
            state, metrics = keyed(state, rest, batch, member["dropout_key"])
            return state, metrics["loss"]

        def train_chunk(states, aux, rest, group_, decay_start, decay_end):
            step = jax.vmap(member_step, in_axes=(0, None, None, 0, None, None))
            return jax.lax.scan(lambda s, _: step(s, aux, rest, group_, decay_start, decay_end), states, None,
                                length=chunk)

        self.train_chunk = jax.jit(train_chunk, donate_argnums=0)

        def init(key):
            model = RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(key))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32)}

        # Op by op, not compiled: a compiled initialiser inlines one random-bits generator per
        # parameter and takes seconds to compile per scheme (docs/results/
        # 2026-11-26-accelerator-h200-train-step.md), more than a small model's ops take to run.
        self.init = init

        def evaluate(params, rest, rows):
            def one(p):
                model = nnx.merge(self.graphdef, nnx.State(p), steps.reseeded(rest, jax.random.key(0)))
                model.eval()
                return row_sums(model, rows)
            return jax.vmap(one)(params)

        self.evaluate_rows = jax.jit(evaluate)

        def signal(params, rest):
            def one(p):
                return nnx.merge(self.graphdef, nnx.State(p), rest).roformer.position.signal()
            return jax.vmap(one)(params)

        self.signal = jax.jit(signal)


# --------------------------------------------------------------------------- one scheme


def _stack(trees: list):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


class SchemeRun:
    """Train one scheme's group and collect its record (the JSON) and test sums (the arrays)."""

    def __init__(self, config, scheme: str, data: study_data.StudyData, device_data: dict):
        self.config, self.scheme, self.data, self.aux = config, scheme, data, device_data
        self.st, self.train_cfg = config.study, config.pretrain.train
        self.group = members(config)
        self.model_cfg = scheme_model_config(config, scheme, data.vocab_size, data.pad_id)
        self.tokens_per_step = int(self.train_cfg.batch_size) * int(self.train_cfg.seq_len)
        eval_sets = [("validation", data.validation)] + [(name, batch) for name, batch in data.variants.items()]
        self.eval_names = [name for name, _ in eval_sets]
        self.eval_rows = {k: np.concatenate([b[k] for _, b in eval_sets]) for k in data.validation}
        self.eval_owner = np.concatenate([np.full(len(b["input_ids"]), i) for i, (_, b) in enumerate(eval_sets)])
        self.diverged: list[int | None] = [None] * len(self.group)
        self.first_loss: np.ndarray | None = None

    def run(self) -> tuple[dict, dict[str, np.ndarray]]:
        st, group = self.st, self.group
        started = time.perf_counter()
        programs = Programs(self.model_cfg, self.config, self.data)
        seeds = sorted({m.seed for m in group})
        member_inputs = {
            "seed_index": jnp.asarray([seeds.index(m.seed) for m in group], jnp.int32),
            "data_key": jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 1))(
                jnp.asarray([m.seed for m in group], jnp.uint32)),
            "dropout_key": jax.vmap(lambda s: jax.random.key(s))(jnp.asarray([m.seed for m in group], jnp.uint32)),
            "rate": jnp.asarray([m.rate for m in group], jnp.float32),
        }
        per_seed = {s: jax.block_until_ready(programs.init(jax.random.key(s))) for s in seeds}
        states = _stack([per_seed[m.seed] for m in group])
        del per_seed
        ends = budgets(self.config)
        branches = optim.cooldown_branches(ends, st.cooldown_fraction)
        trunk_decay = branches[-1]
        evals, budget_records, test_loss = [], [], {}
        timing = {"setup_s": time.perf_counter() - started, "compile_s": 0.0, "train_s": 0.0, "eval_s": 0.0,
                  "branch_s": 0.0}
        evals.append(self._evaluate_trunk(programs, states, 0, timing))
        timing["first_eval_s"] = timing["eval_s"]
        step, compiled = 0, False
        while step < ends[-1]:
            for start, end in branches[:-1]:
                if step == start:   # a cooldown branch from the trunk's state here
                    t0 = time.perf_counter()
                    branch = jax.tree.map(jnp.copy, states)
                    branch = self._train_to(programs, member_inputs, branch, start, end, (start, end), timing)
                    budget_records.append(self._budget(programs, branch, end, test_loss, timing))
                    del branch
                    timing["branch_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            states, losses = programs.train_chunk(states, self.aux, programs.rest, member_inputs, *trunk_decay)
            losses = np.asarray(jax.device_get(losses))
            elapsed = time.perf_counter() - t0
            timing["compile_s" if not compiled else "train_s"] += elapsed
            compiled = True
            step += int(st.eval_every)
            self._watch(losses, step)
            evals.append(self._evaluate_trunk(programs, states, step, timing))
            log.info("%s: step %d/%d (%d members), %.0f tokens/s in all", self.scheme, step, ends[-1], len(group),
                     len(group) * self.tokens_per_step * st.eval_every / max(elapsed, 1e-9))
        budget_records.append(self._budget(programs, states, ends[-1], test_loss, timing, trunk_eval=evals[-1]))
        trained_steps = ends[-1] - st.eval_every + sum(end - start for start, end in branches[:-1])
        timing["wall_s"] = time.perf_counter() - started
        # Every chunk but the first (which compiled the program) is in train_s.
        timing["tokens_per_s"] = len(group) * self.tokens_per_step * trained_steps / max(timing["train_s"], 1e-9)
        record = {
            "scheme": self.scheme, "model": self.model_cfg.to_dict(),
            "parameters": parameter_count(self.model_cfg),
            "members": [dataclasses.asdict(m) for m in group], "tokens_per_step": self.tokens_per_step,
            "evals": evals, "budgets": budget_records, "diverged_at": self.diverged, "timing": timing,
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        }
        return record, test_loss

    def _train_to(self, programs, member_inputs, states, step, end, decay, timing):
        while step < end:
            t0 = time.perf_counter()
            states, losses = programs.train_chunk(states, self.aux, programs.rest, member_inputs, *decay)
            losses = np.asarray(jax.device_get(losses))
            timing["train_s"] += time.perf_counter() - t0
            step += int(self.st.eval_every)
            self._watch(losses, step)
        return states

    def _watch(self, losses: np.ndarray, step: int) -> None:
        """Mark members whose training loss is not finite or above where it started."""
        if self.first_loss is None:
            self.first_loss = losses[0].copy()
        bad = ~np.isfinite(losses) | (losses > self.first_loss[None, :] + 1.0)
        for m in np.flatnonzero(bad.any(axis=0)):
            if self.diverged[m] is None:
                first_bad = int(np.flatnonzero(bad[:, m])[0])
                self.diverged[m] = step - losses.shape[0] + first_bad + 1
                log.warning("%s: member %d (seed %d, rate %g) diverged at step %d", self.scheme, m,
                            self.group[m].seed, self.group[m].rate, self.diverged[m])

    def _rows(self, programs, params, rows: dict) -> dict[str, np.ndarray]:
        """Per member and row: loss and correct sums over `rows` (in eval_batch chunks, the last padded)."""
        size, total = int(self.st.eval_batch), len(rows["input_ids"])
        # A few chunks in flight before any is read back: the device does not wait on the host, and
        # no more than that many chunks' logits are held at once.
        pending, fetched = [], []
        for lo in range(0, total, size):
            chunk = {k: v[lo:lo + size] for k, v in rows.items()}
            pad = size - len(chunk["input_ids"])
            if pad:
                chunk = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0) * (0 if k == "masked_weights" else 1)])
                         for k, v in chunk.items()}
            pending.append((programs.evaluate_rows(params, programs.rest, chunk), size - pad))
            if len(pending) == EVAL_IN_FLIGHT or lo + size >= total:
                fetched += [(jax.device_get(sums), keep) for sums, keep in pending]
                pending = []
        return {k: np.concatenate([np.asarray(sums[k])[:, :keep] for sums, keep in fetched], axis=1)
                for k in ("loss", "correct")}

    def _evaluate_trunk(self, programs, states, step: int, timing: dict) -> dict:
        t0 = time.perf_counter()
        sums = self._rows(programs, states["params"], self.eval_rows)
        weights = self.eval_rows["masked_weights"].sum(-1)
        losses = {}
        for i, name in enumerate(self.eval_names):
            pick = self.eval_owner == i
            losses[name] = sums["loss"][:, pick].sum(1) / max(weights[pick].sum(), 1.0)
        variant_rows = int(self.st.variant_rows)
        plain = sums["loss"][:, self.eval_owner == 0][:, :variant_rows].sum(1) / max(
            weights[self.eval_owner == 0][:variant_rows].sum(), 1.0)
        gaps = {name: (losses[name] - plain).tolist() for name in self.eval_names[1:]}
        signal = {k: np.asarray(v).tolist() for k, v in jax.device_get(programs.signal(states["params"],
                                                                                        programs.rest)).items()}
        accuracy = sums["correct"][:, self.eval_owner == 0].sum(1) / max(weights[self.eval_owner == 0].sum(), 1.0)
        timing["eval_s"] += time.perf_counter() - t0
        return {"step": step, "tokens": step * self.tokens_per_step, "validation_loss": losses["validation"].tolist(),
                "validation_accuracy": accuracy.tolist(), "gaps": gaps, "signal": signal}

    def _budget(self, programs, states, end: int, test_loss: dict, timing: dict, trunk_eval: dict | None = None) -> dict:
        t0 = time.perf_counter()
        validation = trunk_eval["validation_loss"] if trunk_eval else self._evaluate_trunk(
            programs, states, end, {"eval_s": 0.0})["validation_loss"]
        sums = self._rows(programs, states["params"], self.data.test)
        # Summed per test item (a row with all its mask draws): what the bootstrap resamples.
        test_loss[f"budget{end}"] = study_stats.item_sums(sums["loss"], self.data.test["masked_weights"].sum(-1),
                                                          self.data.test_items)[0].astype(np.float32)
        weight = float(self.data.test["masked_weights"].sum())
        timing["eval_s"] += time.perf_counter() - t0
        return {"steps": end, "tokens": end * self.tokens_per_step, "validation_loss": validation,
                "test_loss": (sums["loss"].sum(1) / weight).tolist()}


# --------------------------------------------------------------------------- the study


# Study keys that change how the study is run or read, not what a scheme's group computes:
# changing them keeps finished schemes.
REPORT_ONLY_KEYS = ("schemes", "reference", "margin", "order_threshold", "bootstrap", "memory_limit_gib",
                    "time_limit_s", "data_pack")


def scheme_fingerprint(config, scheme: str, manifest: dict) -> str:
    study = {k: v for k, v in config.study.to_dict().items() if k not in REPORT_ONLY_KEYS}
    return plan.fingerprint(plan.scheme_pretrain_config(config, scheme), study, manifest)


def device_arrays(config, data: study_data.StudyData) -> dict:
    """The training data and masking tables on the device, shared by every scheme."""
    train = config.pretrain.train
    seeds = list(range(int(config.study.seeds)))
    num_rows = data.train["input_ids"].shape[0]
    orders = study_data.pass_orders(seeds, num_rows, study_data.passes_needed(budgets(config)[-1], train.batch_size,
                                                                               num_rows))
    return {"train": {k: jnp.asarray(v) for k, v in data.train.items()}, "orders": jnp.asarray(orders),
            "special": jnp.asarray(data.special), "replacement_ids": jnp.asarray(np.flatnonzero(~data.special),
                                                                                 jnp.int32)}


def data_key(config) -> str:
    """What the splits depend on: the data settings, the sequence length and the split keys.
    Where the files lie is not part of it (the pack is made on one machine and read on
    another, whose checkout sits elsewhere), only their names; nor is the cache."""
    st = config.study
    data = config.pretrain.data.to_dict()
    for key in ("files", "vocab", "hf_path", "tfds_data_dir"):
        data[key] = os.path.basename(str(data.get(key) or ""))
    for key in ("cache_dir", "num_workers"):
        data.pop(key, None)
    return plan.fingerprint(data, int(config.pretrain.train.seq_len),
                            {k: st[k] for k in ("test_fraction", "validation_fraction", "validation_rows",
                                                "variant_rows", "windows", "test_mask_draws", "max_test_rows")})


def study_splits(config) -> study_data.StudyData:
    """The splits: from study.data_pack when given, else built from config.pretrain.data."""
    st = config.study
    if st.get("data_pack"):
        if not Path(st.data_pack).is_file():
            raise ConfigError(f"study.data_pack={st.data_pack!r} is not a file: make it with "
                              "`python -m roformer.ablation.study pack VARIANT PATH` where the corpus is")
        return study_data.load_pack(st.data_pack, data_key(config))
    return study_data.build(DataConfig.from_mapping(config.pretrain.data), seq_len=int(config.pretrain.train.seq_len),
                            test_fraction=st.test_fraction, validation_fraction=st.validation_fraction,
                            validation_rows=st.validation_rows, variant_rows=st.variant_rows, windows=windows(config),
                            test_mask_draws=st.test_mask_draws, max_test_rows=st.max_test_rows)


def run_study(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Train (or resume) every scheme of config.study in `workdir` and write the report; returns it."""
    from roformer.ablation import study_report   # matplotlib and scipy: when a report is written

    validate(config)
    workdir = Path(workdir).resolve()
    (workdir / SCHEMES_DIR).mkdir(parents=True, exist_ok=True)
    write_text_atomic(workdir / CONFIG_RECORD, config.to_json_best_effort(indent=2) + "\n")
    st = config.study
    t0 = time.perf_counter()
    data = study_splits(config)
    if data.test_predictions < st.min_test_predictions:
        raise ConfigError(f"the test split holds {data.test_predictions} masked predictions, fewer than "
                          f"study.min_test_predictions={st.min_test_predictions}: raise study.test_fraction or "
                          "study.test_mask_draws")
    estimates = check_memory(config, data)
    log.info("data ready in %.0f s: %s; memory estimate per group %s", time.perf_counter() - t0,
             json.dumps(data.manifest), {k: f"{v / 2**30:.2f} GiB" for k, v in estimates.items()})
    write_json_atomic(workdir / "data_manifest.json", {**data.manifest, "setup_s": time.perf_counter() - t0})
    aux, longest = None, 0.0
    for scheme in plan.split_list(st.schemes):
        path = workdir / SCHEMES_DIR / f"{scheme}.json"
        fp = scheme_fingerprint(config, scheme, data.manifest)
        if path.is_file() and json.loads(path.read_text()).get("fingerprint") == fp:
            log.info("%s: already trained, skipping", scheme)
            continue
        elapsed = time.perf_counter() - t0
        if st.time_limit_s and longest and elapsed + longest > st.time_limit_s:
            log.warning("time limit: %s and the schemes after it not started (%.0f s gone, a scheme took up to "
                        "%.0f s, study.time_limit_s=%.0f); the same command resumes with them", scheme, elapsed,
                        longest, st.time_limit_s)
            break
        if aux is None:
            aux = device_arrays(config, data)
        record, test_loss = SchemeRun(config, scheme, data, aux).run()
        record.update(fingerprint=fp, memory_estimate_bytes=estimates[scheme])
        longest = max(longest, record["timing"]["wall_s"])
        buffer = io.BytesIO()
        np.savez_compressed(buffer, test_weight=study_stats.item_sums(
            np.zeros((1, len(data.test_items))), data.test["masked_weights"].sum(-1), data.test_items)[1], **test_loss)
        write_bytes_atomic(workdir / SCHEMES_DIR / f"{scheme}.npz", buffer.getvalue())
        write_json_atomic(path, record)
        t = record["timing"]
        log.info("%s: done in %.0f s (set-up and initialisation %.0f s, first evaluation %.0f s, first chunk with "
                 "its compilation %.0f s, training %.0f s, evaluation %.0f s, %.0f tokens/s in all)", scheme,
                 t["wall_s"], t["setup_s"], t["first_eval_s"], t["compile_s"], t["train_s"], t["eval_s"],
                 t["tokens_per_s"])
        study_report.write(config, workdir)
    return study_report.write(config, workdir)


def main(argv: list[str]) -> int:
    """`python -m roformer.ablation.study pack VARIANT PATH [KEY=VALUE ...]`: the splits of
    configs/ablation.py:VARIANT (study.* / pretrain.* keys as overrides) into a pack for a
    machine without the corpus (scripts/gpu_comparison.sh reads runs/study_data/VARIANT.npz)."""
    if len(argv) < 3 or argv[0] != "pack":
        print("usage: python -m roformer.ablation.study pack VARIANT PATH [section.key=value ...]")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = plan.load_config_file("ablation", argv[1])
    for item in argv[3:]:
        name, _, value = item.partition("=")
        section, _, key = name.rpartition(".")
        target = config
        for part in section.split(".") if section else []:
            target = target[part]
        target[key] = type(target[key])(value) if target[key] is not None else value
    validate(config)
    config.study.data_pack = ""
    data = study_splits(config)
    study_data.save_pack(data, argv[2], data_key(config))
    print(f"{argv[2]}: {json.dumps(data.manifest)}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
