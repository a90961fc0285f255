"""One scheme's group of the accelerator comparison (roformer.study) trained: its
compiled programs (the vmapped members' training chunk, evaluation and position signal) and
the run that trains the trunk and its cooldown branches, evaluates them and records the
scheme (the JSON record and the test sums the report's bootstrap resamples).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.study import data as study_data, stats as study_stats
from roformer.study.plan import EVAL_IN_FLIGHT, Member, StudyPlan, parameter_count
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train import optim, steps
from roformer.train.evaluation import padded_chunks, row_sums

log = logging.getLogger("roformer.study")


# --------------------------------------------------------------------------- the programs


class Programs:
    """The compiled programs of one scheme's group."""

    def __init__(self, model_cfg: ModelConfig, plan: StudyPlan, data: study_data.StudyData):
        st, train = plan.study, plan.train
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
        # parameter and takes seconds to compile per scheme (docs/results/archive/
        # 2026-11-26-accelerator-h200-train-step.md), more than a small model's ops take to run.
        self.init = init

        def evaluate(params, rest, rows):
            def one(p):
                model = nnx.merge(self.graphdef, nnx.State(p), steps.reseeded(rest, jax.random.key(0)))
                model.eval()
                return steps.mlm_row_sums(model, rows)
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


def member_inputs(group: list[Member]) -> dict[str, jax.Array]:
    """What the vmapped step reads per member: its seed (the row of the pass orders it reads,
    whatever other seeds the group holds), data and dropout keys, rate. The two keys branch
    from the seed's key apart (fold_in 1 and 2), so no step's dropout key is another step's
    masking key (the train step folds the step, then the dropout site, into its key)."""
    seeds = jnp.asarray([m.seed for m in group], jnp.uint32)
    return {
        "seed_index": jnp.asarray([m.seed for m in group], jnp.int32),
        "data_key": jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 1))(seeds),
        "dropout_key": jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 2))(seeds),
        "rate": jnp.asarray([m.rate for m in group], jnp.float32),
    }


class SchemeRun:
    """Train one scheme's group and collect its record (the JSON) and test sums (the arrays)."""

    def __init__(self, plan: StudyPlan, scheme: str, data: study_data.StudyData, device_data: dict,
                 group: list[Member] | None = None):
        self.plan, self.scheme, self.data, self.aux = plan, scheme, data, device_data
        self.st, self.train_cfg = plan.study, plan.train
        self.group = plan.members() if group is None else group
        self.model_cfg = plan.model_config(scheme, data.vocab_size, data.pad_id)
        self.tokens_per_step = int(self.train_cfg.batch_size) * int(self.train_cfg.seq_len)
        eval_sets = [("validation", data.validation)] + [(name, batch) for name, batch in data.variants.items()]
        self.eval_names = [name for name, _ in eval_sets]
        self.eval_rows = {k: np.concatenate([b[k] for _, b in eval_sets]) for k in data.validation}
        self.eval_owner = np.concatenate([np.full(len(b["input_ids"]), i) for i, (_, b) in enumerate(eval_sets)])
        self.diverged: list[int | None] = [None] * len(self.group)   # the trunk's
        self.first_loss: np.ndarray | None = None
        self.programs: Programs | None = None
        self.states: dict | None = None   # the members' initial states, until run() takes them
        self.programs_s, self.init_s, self.compiled_ahead = 0.0, 0.0, False
        self.evaluated_rows = 0   # rows per member through the evaluation program, padding included
        self.params = None        # after run(): every member's final (last budget's) parameters, stacked

    def compile(self) -> SchemeRun:
        """Build this group's programs and compile each for the shapes it will be called with
        (the training chunk, evaluation of a validation and a test chunk, the position signal),
        which its first calls would otherwise compile; then initialise its members. Touches
        nothing shared but the read-only data, so it may run on a worker thread while another
        group trains (CompileAhead); the initial states then wait on the device for their turn
        (study_plan.check_memory counts them)."""
        t0 = time.perf_counter()
        programs = Programs(self.model_cfg, self.plan, self.data)
        n = len(self.group)
        states = jax.eval_shape(lambda key: _stack([programs.init(key)] * n), jax.random.key(0))
        trunk_decay = optim.cooldown_branches(list(self.plan.budgets), self.st.cooldown_fraction)[-1]
        programs.train_chunk.lower(states, self.aux, programs.rest, member_inputs(self.group), *trunk_decay).compile()
        size = int(self.st.eval_batch)
        for rows in (self.eval_rows, self.data.test):
            chunk, _ = next(padded_chunks(rows, size))
            programs.evaluate_rows.lower(states["params"], programs.rest, chunk).compile()
        programs.signal.lower(states["params"], programs.rest).compile()
        t1 = time.perf_counter()
        # Each seed's parameters once (members that share a seed start alike, at any rate).
        seeds = sorted({m.seed for m in self.group})
        per_seed = {s: jax.block_until_ready(programs.init(jax.random.key(s))) for s in seeds}
        self.states = jax.block_until_ready(_stack([per_seed[m.seed] for m in self.group]))
        self.init_s = time.perf_counter() - t1
        self.programs, self.programs_s = programs, time.perf_counter() - t0
        return self

    def run(self) -> tuple[dict, dict[str, np.ndarray]]:
        st, group = self.st, self.group
        started = time.perf_counter()
        if self.programs is None:
            self.compile()
        programs = self.programs
        states, self.states = self.states, None   # donated to the first chunk
        inputs = member_inputs(group)
        ends = list(self.plan.budgets)
        branches = optim.cooldown_branches(ends, st.cooldown_fraction)
        trunk_decay = branches[-1]
        evals, budget_records, test_loss = [], [], {}
        # compile_s: the first chunk (with its compilation where compile() did not run first).
        timing = {"setup_s": time.perf_counter() - started, "compile_s": 0.0, "train_s": 0.0, "eval_s": 0.0,
                  "branch_s": 0.0, "programs_s": self.programs_s, "init_s": self.init_s,
                  "compiled_ahead": self.compiled_ahead}
        evals.append(self._evaluate_trunk(programs, states, 0, timing))
        timing["first_eval_s"] = timing["eval_s"]
        step, compiled = 0, False
        while step < ends[-1]:
            for start, end in branches[:-1]:
                if step == start:   # a cooldown branch from the trunk's state here
                    t0 = time.perf_counter()
                    branch = jax.tree.map(jnp.copy, states)
                    # The branch inherits what the trunk did up to here, not after.
                    diverged = list(self.diverged)
                    branch = self._train_to(programs, inputs, branch, start, end, (start, end), timing, diverged)
                    budget_records.append(self._budget(programs, branch, end, test_loss, timing, diverged))
                    del branch
                    timing["branch_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            states, losses = programs.train_chunk(states, self.aux, programs.rest, inputs, *trunk_decay)
            losses = np.asarray(jax.device_get(losses))
            elapsed = time.perf_counter() - t0
            timing["compile_s" if not compiled else "train_s"] += elapsed
            compiled = True
            step += int(st.eval_every)
            self._watch(losses, step, self.diverged)
            evals.append(self._evaluate_trunk(programs, states, step, timing))
            log.info("%s: step %d/%d (%d members), %.0f tokens/s in all", self.scheme, step, ends[-1], len(group),
                     len(group) * self.tokens_per_step * st.eval_every / max(elapsed, 1e-9))
        budget_records.append(self._budget(programs, states, ends[-1], test_loss, timing, self.diverged,
                                           trunk_eval=evals[-1]))
        self.params = states["params"]
        trained_steps = ends[-1] - st.eval_every + sum(end - start for start, end in branches[:-1])
        timing["wall_s"] = time.perf_counter() - started
        # Every chunk but the first (which compiled the program) is in train_s.
        timing["tokens_per_s"] = len(group) * self.tokens_per_step * trained_steps / max(timing["train_s"], 1e-9)
        # Evaluation's forward tokens per second, all members, to set beside training's (which
        # runs forward and backward) when judging whether evaluation keeps the device busy.
        timing["eval_tokens_per_s"] = (len(group) * self.evaluated_rows * int(self.train_cfg.seq_len)
                                       / max(timing["eval_s"], 1e-9))
        record = {
            "scheme": self.scheme, "model": self.model_cfg.to_dict(),
            "parameters": parameter_count(self.model_cfg),
            "members": [dataclasses.asdict(m) for m in group], "tokens_per_step": self.tokens_per_step,
            "evals": evals, "budgets": budget_records, "diverged_at": self.diverged, "timing": timing,
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        }
        return record, test_loss

    def _train_to(self, programs, inputs, states, step, end, decay, timing, diverged: list[int | None]):
        while step < end:
            t0 = time.perf_counter()
            states, losses = programs.train_chunk(states, self.aux, programs.rest, inputs, *decay)
            losses = np.asarray(jax.device_get(losses))
            timing["train_s"] += time.perf_counter() - t0
            step += int(self.st.eval_every)
            self._watch(losses, step, diverged, f"budget {end}'s cooldown")
        return states

    def _watch(self, losses: np.ndarray, step: int, diverged: list[int | None], where: str = "trunk") -> None:
        """Mark in `diverged` (the trunk's, or a cooldown branch's) the members whose training loss
        is not finite or above where it started, at the first step it is."""
        if self.first_loss is None:
            self.first_loss = losses[0].copy()
        bad = ~np.isfinite(losses) | (losses > self.first_loss[None, :] + 1.0)
        for m in np.flatnonzero(bad.any(axis=0)):
            if diverged[m] is None:
                first_bad = int(np.flatnonzero(bad[:, m])[0])
                diverged[m] = step - losses.shape[0] + first_bad + 1
                log.warning("%s: member %d (seed %d, rate %g) diverged at step %d (%s)", self.scheme, m,
                            self.group[m].seed, self.group[m].rate, diverged[m], where)

    def _rows(self, programs, params, rows: dict) -> dict[str, np.ndarray]:
        """Per member and row: loss and correct sums over `rows` (in eval_batch chunks, the last padded)."""
        sums, evaluated = row_sums(programs.evaluate_rows, params, programs.rest, rows, int(self.st.eval_batch),
                                   in_flight=EVAL_IN_FLIGHT)
        self.evaluated_rows += evaluated
        return sums

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

    def _budget(self, programs, states, end: int, test_loss: dict, timing: dict, diverged: list[int | None],
                trunk_eval: dict | None = None) -> dict:
        """The budget's record. `diverged`: its model's divergences (the trunk's up to the fork,
        then its branch's); a member whose validation loss is not finite is marked at `end`, as
        the training loss (taken before each update) never sees the last update's result."""
        t0 = time.perf_counter()
        validation = trunk_eval["validation_loss"] if trunk_eval else self._evaluate_trunk(
            programs, states, end, {"eval_s": 0.0})["validation_loss"]
        for m in np.flatnonzero(~np.isfinite(np.asarray(validation, float))):
            if diverged[m] is None:
                diverged[m] = end
                log.warning("%s: member %d (seed %d, rate %g) diverged by step %d (validation loss not finite)",
                            self.scheme, m, self.group[m].seed, self.group[m].rate, end)
        sums = self._rows(programs, states["params"], self.data.test)
        # Summed per test item (a row with all its mask draws): what the bootstrap resamples.
        test_loss[f"budget{end}"] = study_stats.item_sums(sums["loss"], self.data.test["masked_weights"].sum(-1),
                                                          self.data.test_items)[0].astype(np.float32)
        weight = float(self.data.test["masked_weights"].sum())
        timing["eval_s"] += time.perf_counter() - t0
        return {"steps": end, "tokens": end * self.tokens_per_step, "validation_loss": validation,
                "test_loss": (sums["loss"].sum(1) / weight).tolist(), "diverged_at": list(diverged)}


class CompileAhead:
    """Groups prepared ahead. While the device trains one group, worker threads (`groups` of
    them) build the next groups' programs and compile them (SchemeRun.compile): XLA compiles
    on the host's cores, so the device does not wait for each scheme's compilation in turn.
    With `groups` 0, a group is prepared when its turn comes."""

    def __init__(self, prepare: Callable[..., SchemeRun], groups: int):
        self.prepare, self.groups = prepare, groups
        self.pool = ThreadPoolExecutor(groups, thread_name_prefix="compile-ahead") if groups else None
        self.pending: dict[object, Future] = {}

    def submit(self, key, *args) -> None:
        """Start preparing `prepare(*args)` on a worker thread (once per key)."""
        if self.pool is not None and key not in self.pending:
            self.pending[key] = self.pool.submit(self.prepare, *args)

    def ready(self, key) -> bool:
        """Whether the group submitted under `key` is compiled (its worker finished without error)."""
        future = self.pending.get(key)
        return future is not None and future.done() and future.exception() is None

    def take(self, key, *args) -> SchemeRun:
        """The group submitted under `key` (waiting for it), else prepared here."""
        future = self.pending.pop(key, None)
        if future is not None:
            try:
                run = future.result()
                run.compiled_ahead = True
                return run
            except Exception:   # what failed there fails here too, with this thread's traceback
                log.warning("%s: compiling ahead failed; compiling here", key, exc_info=True)
        return self.prepare(*args)

    def close(self) -> None:
        """Drop what has not started; a compilation under way finishes on its own."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def merge_groups(record: dict, arrays: dict[str, np.ndarray], extra: dict,
                 extra_arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """One scheme's record and test sums with a second group's (same seeds, schedule and
    evaluations; other rates) appended member-wise, as if one group had trained them all.
    `arrays` may hold more members than `record` (written before a record that did not land):
    only the record's own count is kept."""
    evals = [{**a, "validation_loss": a["validation_loss"] + b["validation_loss"],
              "validation_accuracy": a["validation_accuracy"] + b["validation_accuracy"],
              "gaps": {k: v + b["gaps"][k] for k, v in a["gaps"].items()},
              "signal": {k: v + b["signal"][k] for k, v in a["signal"].items()}}
             for a, b in zip(record["evals"], extra["evals"], strict=True)]
    budgets_ = [{**a, "validation_loss": a["validation_loss"] + b["validation_loss"],
                 "test_loss": a["test_loss"] + b["test_loss"]}
                for a, b in zip(record["budgets"], extra["budgets"], strict=True)]
    for merged_budget, a, b in zip(budgets_, record["budgets"], extra["budgets"]):
        # A record written before budgets kept their own divergences has none: the report then
        # reads the trunk's (roformer.study.report.budget_divergence).
        merged_budget.pop("diverged_at", None)
        if "diverged_at" in a and "diverged_at" in b:
            merged_budget["diverged_at"] = a["diverged_at"] + b["diverged_at"]
    merged = {**record, "members": record["members"] + extra["members"], "evals": evals, "budgets": budgets_,
              "diverged_at": record["diverged_at"] + extra["diverged_at"]}
    n = len(record["members"])
    merged_arrays = {k: v if k not in extra_arrays else np.concatenate([v[:n], extra_arrays[k]])
                     for k, v in arrays.items()}
    return merged, merged_arrays
