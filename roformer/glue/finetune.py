"""Fine-tune one sequence-classification model on one task with one seed, and predict.

Built so an accelerator is never waiting on the host:
- the steps are jitted functions of split state (plain pytrees of params, optimizer
  state and RNG state), as in pretraining, not NNX objects walked on every call;
- one call of the train program runs `steps_per_call` optimizer steps (a scan over that
  many consecutive batches), so the host's cost of a call (assembling and sending the
  batches, flattening the state) is paid once for many steps, with the same updates in the
  same order as one step per call (test);
- a step's batch is padded to its own length (`padding="step"`: one program with a branch
  per padded length), to the longest of its call (`"call"`: one program per length, with
  no conditional, since on a GPU each conditional makes the host wait for the device), or
  its examples are packed end to end into a few full-length rows (`"packed"`);
- the learning rate and the step number are inputs of the program, so one compiled program
  serves every schedule: all seeds, and every task with the same head and batch size;
- every program a task will run is compiled before its first step (`Programs.prepare`,
  in parallel threads), or loaded whole from a program store kept with jax's persistent
  cache, which skips tracing it too (`roformer.glue.program_store`);
- nothing is fetched from the device while training or predicting: losses and
  predictions stay there and are read once at the end (the host only waits, when it is
  `CALLS_AHEAD` calls ahead of the device, for the oldest call).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from roformer.errors import ConfigError
from roformer.glue.features import (Features, PaddedRows, bucket_lengths, eval_batches, pack_rows, planned_train_batches,
                                    row_buckets)
from roformer.glue.program_store import ProgramStore, graph_text, tree_text
from roformer.glue.resume import SeedCheckpoints
from roformer.model import ModelConfig, RoFormerForSequenceClassification
from roformer.train.optim import decay_mask, make_schedule
from roformer.train.progress import progress_bar
from roformer.train.steps import reseeded

log = logging.getLogger("roformer.glue")

MODEL_INPUTS = ("input_ids", "token_type_ids", "lengths")
TRAIN_INPUTS = (*MODEL_INPUTS, "labels", "weights")
PACKED_INPUTS = ("input_ids", "token_type_ids", "segment_ids", "positions", "cls_index", "labels", "weights")
# Optimizer steps per call of the train program. More steps per call spread the host's
# cost of a call thinner; the last call of a run pads with steps that change nothing.
STEPS_PER_CALL = 16
# Calls the host may queue ahead of the device. The host now assembles a call far faster than
# the device runs it, and each queued call holds its batches in device memory: a bounded lead
# keeps the device busy without piling up a whole run's batches there.
CALLS_AHEAD = 8
# How a train step's batch is padded (config.train_padding):
#   step  to the step's own padded length; one program runs every length, a branch each.
#   call  to the longest padded length of the step's call; a program per length and no
#         branch: XLA:GPU reads a conditional's branch index back to the host, so a
#         branch per step is a wait of the host for the device per step, and the device
#         idles while the host launches the branch.
#   packed  a step's examples laid end to end in rows of max_seq_len tokens, each its own
#         segment (attention stays within it, positions start at 0), the call's steps at
#         their largest number of rows: far fewer padding tokens, no branch, but attention
#         takes a segment mask instead of per-row lengths.
#   auto  per task: packed where packed rows hold at most PACKING_PAYS of the tokens of the
#         backend's padded form, else that form: call on GPUs, step elsewhere (on a CPU
#         call's longer padding is more work, and a TPU decides its branches on the
#         device). Where examples nearly fill their rows, packing saves no work and its
#         segment mask costs some.
TRAIN_PADDINGS = ("auto", "step", "call", "packed")
PACKING_PAYS = 0.8
# How a prediction batch is padded (config.eval_padding): "bucket" to the first of the
# power-of-two lengths that holds its longest example (batches are sorted by length), "full"
# to max_seq_len. "auto": bucket on a CPU, full on accelerators, where a dev set's batches at
# full length cost the device little more, while every further length is one more program to
# compile (seconds each) before the first step.
EVAL_PADDINGS = ("auto", "bucket", "full")


def padded_form(platform: str | None = None) -> str:
    """The padding auto uses where it does not pack, on `platform` (default: jax's backend)."""
    return "call" if (platform or jax.default_backend()) == "gpu" else "step"


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """What a compiled train program is specialised to: the batch size, the padded lengths
    it can run (one branch each), the steps per call, for packed batches the rows a
    step's (or a micro-batch's) examples are packed into (0: a row per example), and the
    micro-batches a step's gradients are accumulated over (config.grad_accum)."""
    batch_size: int
    lengths: tuple[int, ...]
    steps_per_call: int
    rows: int = 0
    micro_batches: int = 1

    @classmethod
    def for_protocol(cls, protocol: "Protocol", steps_per_call: int = STEPS_PER_CALL) -> "TrainProgram":
        return cls(protocol.batch_size, bucket_lengths(protocol.max_seq_len), steps_per_call,
                   micro_batches=protocol.grad_accum)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    @property
    def inputs(self) -> tuple[str, ...]:
        """The per-step batch inputs this program takes (besides rate, step and branch)."""
        return PACKED_INPUTS if self.rows else TRAIN_INPUTS

    def branch(self, length: int) -> int:
        """The branch a step of this padded length runs: the first length that holds it."""
        return next(i for i, own in enumerate(self.lengths) if own >= length)


def call_programs(plan: list[tuple[int, np.ndarray]], protocol: "Protocol", padding: str,
                  steps_per_call: int = STEPS_PER_CALL, lengths: np.ndarray | None = None) -> list[TrainProgram]:
    """The train program of each call of a run of `plan` ((padded length, rows) per step);
    `lengths`, the examples' token counts (`Features.lengths`), decides the rows of packed
    batches."""
    calls = [plan[first:first + steps_per_call] for first in range(0, len(plan), steps_per_call)]
    micro = protocol.grad_accum
    if padding == "step":
        return [TrainProgram.for_protocol(protocol, steps_per_call)] * len(calls)
    if padding == "call":
        return [TrainProgram(protocol.batch_size, (max(length for length, _ in call),), steps_per_call,
                             micro_batches=micro) for call in calls]
    if padding != "packed" or lengths is None:
        raise ValueError(f"padding must be 'step', 'call' or 'packed' (with the examples' lengths), got {padding!r}")
    size = protocol.batch_size // micro
    width, buckets = protocol.max_seq_len, row_buckets(size)
    programs = []
    for call in calls:
        needed = max(pack_rows(lengths[part], width)[2] for _, examples in call
                     for part in micro_batch_rows(examples, size, micro))
        programs.append(TrainProgram(protocol.batch_size, (width,), steps_per_call,
                                     rows=next(n for n in buckets if n >= needed), micro_batches=micro))
    return programs


def micro_batch_rows(rows: np.ndarray, size: int, micro_batches: int) -> list[np.ndarray]:
    """A step's example rows cut into `micro_batches` consecutive parts of `size` (a short
    last batch leaves the last parts short or empty)."""
    return [rows[i * size:(i + 1) * size] for i in range(micro_batches)]


def processed_tokens(plan: list[tuple[int, np.ndarray]], protocol: "Protocol", padding: str, lengths: np.ndarray,
                     steps_per_call: int = STEPS_PER_CALL) -> int:
    """The token slots the train programs of a run of `plan` compute with `padding`,
    padding steps included (a program of one length computes them; step's branch does not)."""
    if padding == "step":
        return sum(length for length, _ in plan) * protocol.batch_size
    return sum(max(p.lengths) * (p.rows * p.micro_batches or p.batch_size) * p.steps_per_call
               for p in call_programs(plan, protocol, padding, steps_per_call, lengths))


def task_padding(setting: str, features: Features, protocol: "Protocol", platform: str | None = None,
                 steps_per_call: int = STEPS_PER_CALL) -> tuple[str, str]:
    """(the padding a task's runs use, why): `setting` unless it is "auto", which packs
    when seed 0's plan packed is at most PACKING_PAYS of its tokens in the backend's
    padded form (`padded_form`)."""
    if setting not in TRAIN_PADDINGS:
        raise ConfigError(f"train_padding must be one of {TRAIN_PADDINGS}, got {setting!r}")
    if setting != "auto":
        return setting, "train_padding=" + setting
    padded = padded_form(platform)
    plan = planned_train_batches(features, protocol.batch_size, protocol.max_seq_len, 0,
                                 protocol.total_steps(len(features)))
    share = (processed_tokens(plan, protocol, "packed", features.lengths, steps_per_call)
             / processed_tokens(plan, protocol, padded, features.lengths, steps_per_call))
    chosen = "packed" if share <= PACKING_PAYS else padded
    return chosen, f"auto: packed rows would compute {share:.2f} of the tokens of {padded} padding"


def train_programs(features: Features, protocol: "Protocol", seeds: Iterable[int], padding: str,
                   steps_per_call: int = STEPS_PER_CALL) -> list[TrainProgram]:
    """Every train program the runs of `seeds` on `features` call (to compile them first)."""
    total = protocol.total_steps(len(features))
    found = {}
    for seed in seeds:
        plan = planned_train_batches(features, protocol.batch_size, protocol.max_seq_len, seed, total)
        found.update(dict.fromkeys(call_programs(plan, protocol, padding, steps_per_call, features.lengths)))
    return list(found)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The hyper-parameters of one task's fine-tuning (global config + per-task override)."""
    learning_rate: float
    batch_size: int
    num_epochs: float
    max_steps: int
    warmup_fraction: float
    weight_decay: float
    max_seq_len: int
    max_train_examples: int
    decay: str
    b1: float
    b2: float
    eps: float
    clip_norm: float
    grad_accum: int = 1     # micro-batches per optimizer step (pretraining's train.grad_accum)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, task: str) -> "Protocol":
        """The protocol of `task` under `config`; a key with a default here (grad_accum) may be
        absent (the config.json of a run from before it)."""
        override = config.per_task.get(task, {}) if "per_task" in config else {}
        values = {}
        for field in dataclasses.fields(cls):
            value = override.get(field.name) if field.name in override else None
            if value is None:
                value = config[field.name] if field.default is dataclasses.MISSING else config.get(field.name,
                                                                                                     field.default)
            values[field.name] = value
        return cls(**values)

    def check(self, task: str) -> None:
        """Refuse settings no fine-tuning can run with; run_glue asks before it writes anything."""
        where = f"GLUE protocol of {task}:"
        if self.max_seq_len < 8:
            raise ConfigError(f"{where} max_seq_len must be at least 8, got {self.max_seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"{where} batch_size must be at least 1, got {self.batch_size}")
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ConfigError(f"{where} batch_size={self.batch_size} must be a multiple of grad_accum="
                              f"{self.grad_accum} (each step's gradients are accumulated over that many "
                              "micro-batches of batch_size / grad_accum examples)")
        if self.num_epochs <= 0 and self.max_steps <= 0:
            raise ConfigError(f"{where} no training steps: num_epochs={self.num_epochs}, max_steps={self.max_steps}")
        if self.decay not in ("linear", "cosine"):
            raise ConfigError(f"{where} decay must be 'linear' or 'cosine', got {self.decay!r}")

    def total_steps(self, num_train: int) -> int:
        steps = math.ceil(self.num_epochs * math.ceil(num_train / self.batch_size))
        if self.max_steps > 0:
            steps = min(steps, self.max_steps)
        if steps <= 0:
            raise ConfigError(f"no training steps: {num_train} training examples, "
                              f"num_epochs={self.num_epochs}, max_steps={self.max_steps}")
        return steps

    def schedule(self, total_steps: int) -> optax.Schedule:
        return make_schedule(learning_rate=self.learning_rate, total_steps=total_steps,
                             warmup_steps=int(round(self.warmup_fraction * total_steps)), decay=self.decay)

    @property
    def update_settings(self) -> tuple:
        """What the compiled train step depends on besides shapes (not the learning rate)."""
        return (self.b1, self.b2, self.eps, self.weight_decay, self.clip_norm)


def unit_rate_adamw(b1: float, b2: float, eps: float, weight_decay: float, clip_norm: float):
    """optax.adamw after global-norm clipping, with the learning rate left out (the updates
    are -(adam + weight_decay * param)): the train step multiplies them by the step's rate,
    which equals optax.adamw on the same schedule (test)."""
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip_norm > 0 else []
    parts += [optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
              optax.add_decayed_weights(weight_decay, mask=decay_mask), optax.scale(-1.0)]
    return optax.chain(*parts)


def classification_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array,
                        regression: bool, total_weight: jax.Array | None = None) -> jax.Array:
    """Weighted mean cross-entropy, or squared error for a regression head; with
    `total_weight` (a micro-batch's step's weight), the weighted sum over it, so that the
    micro-batches' losses and gradients add up to the step's."""
    if regression:
        per_example = jnp.square(logits[:, 0] - labels.astype(jnp.float32))
    else:
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if total_weight is None:
        return jnp.sum(per_example * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return jnp.sum(per_example * weights) / total_weight


def _forward(model, batch):
    return model(batch["input_ids"], token_type_ids=batch["token_type_ids"], lengths=batch["lengths"])


def _packed_forward(model, batch):
    """Logits [batch, labels] of examples packed into rows (`PaddedRows.packed`): the encoder
    over the rows, then the head on each example's first token."""
    hidden = model.roformer(batch["input_ids"], token_type_ids=batch["token_type_ids"],
                            positions=batch["positions"], segment_ids=batch["segment_ids"])
    first_tokens = hidden.reshape(-1, hidden.shape[-1])[batch["cls_index"]]
    return model.classifier(first_tokens[:, None])


def create_model(model_config: ModelConfig, num_labels: int, seed: int,
                 encoder_state: nnx.State | None = None) -> RoFormerForSequenceClassification:
    """A fresh classifier; the encoder is overwritten with `encoder_state` when given
    (pretrained init), the head always starts from the seed."""
    model = RoFormerForSequenceClassification(model_config, num_labels, rngs=nnx.Rngs(seed))
    if encoder_state is not None:
        nnx.update(model.roformer, encoder_state)
    return model


@dataclasses.dataclass
class Classifier:
    """A classifier as split state: the graph, float32 params and RNG state (pytrees)."""
    graphdef: nnx.GraphDef
    params: dict
    rest: nnx.State

    @classmethod
    def split(cls, model: RoFormerForSequenceClassification) -> "Classifier":
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return cls(graphdef, nnx.to_pure_dict(params), rest)

    def model(self) -> RoFormerForSequenceClassification:
        """The NNX model with these params, in eval mode (a copy: the split state is kept)."""
        model = nnx.merge(self.graphdef, nnx.State(jax.tree.map(jnp.asarray, self.params)), self.rest)
        model.eval()
        return model


def _batch_spec(batch_size: int, length: int, inputs: Iterable[str], label_dtype, rows: int = 0,
                micro_batches: int = 1) -> dict:
    """Shapes and dtypes of a batch's `inputs`; with `rows`, of a packed batch (`PaddedRows.packed`);
    with `micro_batches` > 1, of that many micro-batches of batch_size / micro_batches, stacked."""
    size = batch_size // micro_batches
    lead = (micro_batches,) if micro_batches > 1 else ()
    token_shape = (*lead, rows or size, length)
    shapes = {"input_ids": token_shape, "token_type_ids": token_shape, "segment_ids": token_shape,
              "positions": token_shape, "cls_index": (*lead, size),
              "lengths": (*lead, size), "labels": (*lead, size), "weights": (*lead, size)}
    dtypes = {"labels": label_dtype, "weights": jnp.float32}
    return {k: jax.ShapeDtypeStruct(shapes[k], dtypes.get(k, jnp.int32)) for k in inputs}


class Programs:
    """The compiled train and predict programs of one architecture (graph, number of
    labels) and one optimizer setting, keyed by batch shape; kept for every seed and task
    that share them, and, with a `store`, for later runs. `device`: the device the programs
    are lowered for (default jax's); another platform's, to compile them for a target this
    host does not have (roformer.glue_launch_check)."""

    def __init__(self, classifier: Classifier, update_settings: tuple, regression: bool,
                 store: ProgramStore | None = None, device=None):
        self.graphdef = classifier.graphdef
        self.regression = regression
        self.tx = unit_rate_adamw(*update_settings)
        self.label_dtype = jnp.float32 if regression else jnp.int32
        self._placed = {} if device is None else {"sharding": jax.sharding.SingleDeviceSharding(device)}
        self.abstract_params = self._abstract(classifier.params)
        self.abstract_opt_state = self._abstract(jax.eval_shape(self.tx.init, self.abstract_params))
        self.abstract_rest = self._abstract(classifier.rest)
        self._train, self._predict = {}, {}
        self.compile_seconds = 0.0
        self.store, self.loaded = store, 0     # programs loaded from the store
        # what every program computes besides its kind and shapes (the store's key)
        self._description = {
            "graph": graph_text(self.graphdef), "update_settings": list(update_settings), "regression": regression,
            "state": tree_text((self.abstract_params, self.abstract_opt_state, self.abstract_rest)),
            "label_dtype": str(jnp.dtype(self.label_dtype))} if store else None

    def _abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, **self._placed), tree)

    def gradients(self, packed: bool = False):
        """The loss and gradients of one [batch, length] batch (or one packed batch): (params,
        rest, batch, base_key, step) -> (loss, grads), a pure function."""
        graphdef, regression = self.graphdef, self.regression
        forward = _packed_forward if packed else _forward

        def loss_and_grads(params, rest, batch, base_key, step, total_weight=None):
            def loss_fn(params):
                model = nnx.merge(graphdef, nnx.State(params), reseeded(rest, jax.random.fold_in(base_key, step)))
                model.train()
                return classification_loss(forward(model, batch), batch["labels"], batch["weights"], regression,
                                           total_weight)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            return loss.astype(jnp.float32), grads

        return loss_and_grads

    def update(self, params, opt_state, grads, learning_rate):
        """One optimizer update at `learning_rate`: (params, opt_state)."""
        updates, opt_state = self.tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: learning_rate * u, updates)
        return optax.apply_updates(params, updates), opt_state

    def single_step(self):
        """One optimizer step on one [batch, length] batch: (params, opt_state, rest, batch,
        learning_rate, base_key, step) -> (params, opt_state, loss), a pure function."""
        loss_and_grads, update = self.gradients(), self.update

        def train_step(params, opt_state, rest, batch, learning_rate, base_key, step):
            loss, grads = loss_and_grads(params, rest, batch, base_key, step)
            return *update(params, opt_state, grads, learning_rate), loss

        return train_step

    def _train_fn(self, program: TrainProgram):
        """Steps over stacked batches [steps, batch, max(lengths)]: step i computes its
        gradients in branch `branch[i]`, on its batch cut to lengths[branch[i]], then
        updates. The update is outside the branches, so the program holds one copy of it,
        not one per length: the optimizer's code outweighs a forward and backward pass.
        A padding step of a run's last call (rows of weight 0 at rate 0, `call_inputs`) is
        an update that leaves every parameter exactly as it is, its gradients being zero
        (the optimizer's moments move, but a run's optimizer state ends with its last
        call). With several lengths it takes branch len(lengths), which computes nothing;
        a program of one length has no branch at all and computes the zero gradients.
        No conditional skips the update, because a conditional on a GPU is a wait of the
        host for the device. A packed program has one length, the rows' width.
        With micro-batches (config.grad_accum), a step's inputs are [micro_batches, ...] and its
        gradients the sum over them, in a loop that keeps one micro-batch's activations alive
        at a time: each micro-batch's loss is its weighted sum over the step's weight, so they
        add up to the step's loss and gradients (test); micro-batch i draws its dropout from
        the step's key folded with i."""
        lengths, inputs, micro_batches = program.lengths, program.inputs, program.micro_batches
        loss_and_grads, update = self.gradients(packed=program.rows > 0), self.update

        def train_steps(params, opt_state, rest, batches, base_key):
            def one_length(length):
                def run(params, xs):
                    batch = {k: xs[k][:, :length] if k in ("input_ids", "token_type_ids") else xs[k]
                             for k in inputs}
                    return loss_and_grads(params, rest, batch, base_key, xs["step"])

                def accumulated(params, xs):
                    total_weight = jnp.maximum(jnp.sum(xs["weights"]), 1.0)
                    step_key = jax.random.fold_in(base_key, xs["step"])

                    def micro_batch(carry, micro):
                        index, part = micro
                        batch = {k: part[k][:, :length] if k in ("input_ids", "token_type_ids") else part[k]
                                 for k in inputs}
                        loss, grads = loss_and_grads(params, rest, batch, step_key, index, total_weight)
                        return jax.tree.map(jnp.add, carry, (loss, grads)), None

                    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
                    parts = (jnp.arange(micro_batches), {k: xs[k] for k in inputs})
                    return jax.lax.scan(micro_batch, zeros, parts)[0]

                return run if micro_batches == 1 else accumulated

            def padding_step(params, xs):
                return jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params)

            def gradients(params, xs):
                if len(lengths) == 1:
                    return one_length(lengths[0])(params, xs)
                return jax.lax.switch(xs["branch"], [*map(one_length, lengths), padding_step], params, xs)

            def body(carry, xs):
                params, opt_state = carry
                loss, grads = gradients(params, xs)
                return update(params, opt_state, grads, xs["learning_rate"]), loss

            (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), batches)
            return params, opt_state, losses

        return jax.jit(train_steps, donate_argnums=(0, 1))

    def _predict_fn(self):
        graphdef, regression = self.graphdef, self.regression

        def predict_step(params, rest, batch):
            model = nnx.merge(graphdef, nnx.State(params), rest)
            model.eval()
            logits = _forward(model, batch)
            return logits[:, 0] if regression else jnp.argmax(logits, axis=-1).astype(jnp.int32)

        return jax.jit(predict_step)

    def lower_train(self, program: TrainProgram):
        """The train program, traced and lowered for this architecture's state (not compiled)."""
        key = self._abstract(jax.eval_shape(lambda: jax.random.key(0)))
        steps = program.steps_per_call
        batches = {k: jax.ShapeDtypeStruct((steps, *v.shape), v.dtype, **self._placed) for k, v in
                   _batch_spec(program.batch_size, max(program.lengths), program.inputs, self.label_dtype,
                               program.rows, program.micro_batches).items()}
        batches.update(self._abstract(dict(learning_rate=jax.ShapeDtypeStruct((steps,), jnp.float32),
                                           step=jax.ShapeDtypeStruct((steps,), jnp.int32),
                                           branch=jax.ShapeDtypeStruct((steps,), jnp.int32))))
        return self._train_fn(program).lower(
            self.abstract_params, self.abstract_opt_state, self.abstract_rest, batches, key)

    def lower_predict(self, batch_size: int, length: int):
        """The predict program of [batch_size, length] batches, traced and lowered (not compiled)."""
        return self._predict_fn().lower(self.abstract_params, self.abstract_rest,
                                        self._abstract(_batch_spec(batch_size, length, MODEL_INPUTS,
                                                                   self.label_dtype)))

    def _describe(self, kind: str, shape) -> dict:
        return {**self._description, "kind": kind,
                "shape": dataclasses.astuple(shape) if kind == "train" else list(shape)}

    def _compile(self, kind: str, shape, lowered):
        compiled = lowered.compile()
        if self.store:
            self.store.save(self._describe(kind, shape), compiled)
        return compiled

    def prepare(self, train_programs: Iterable[TrainProgram], predict_shapes: Iterable[tuple[int, int]],
                threads: int = 8) -> float:
        """Compile every train program and (batch, length) predict program not compiled yet,
        in parallel, or load it from the store; returns the seconds it took. A program
        compiled is traced here too, so a model whose attention a kernel cannot take fails
        now, before any training (one loaded was traced by an earlier run of the same code)."""
        todo = [("train", p) for p in dict.fromkeys(train_programs) if p not in self._train]
        todo += [("predict", s) for s in sorted(set(predict_shapes)) if s not in self._predict]
        if not todo:
            return 0.0
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo)))) as pool:
            found = (list(pool.map(lambda item: self.store.load(self._describe(*item)), todo)) if self.store
                     else [None] * len(todo))
            missing = [item for item, program in zip(todo, found) if program is None]
            if missing:   # a first run's long silent phase otherwise (later runs load them)
                log.info("compiling %d programs (%d train, %d predict)", len(missing),
                         sum(kind == "train" for kind, _ in missing), sum(kind == "predict" for kind, _ in missing))
            lowered = [self.lower_train(key) if kind == "train" else self.lower_predict(*key)
                       for kind, key in missing]      # tracing is Python: one thread
            compiled = iter(pool.map(lambda item, low: self._compile(*item, low), missing, lowered))
            for (kind, shape), program in zip(todo, found):
                (self._train if kind == "train" else self._predict)[shape] = next(compiled) if program is None else program
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        self.loaded += len(todo) - len(missing)
        if self.store:
            log.info("programs: %d loaded from the store, %d compiled (%.1f s)",
                     len(todo) - len(missing), len(missing), seconds)
        return seconds

    def train_steps(self, program: TrainProgram):
        if program not in self._train:
            self.prepare([program], [])
        return self._train[program]

    def predict_step(self, batch_size: int, length: int):
        if (batch_size, length) not in self._predict:
            self.prepare([], [(batch_size, length)])
        return self._predict[(batch_size, length)]


def _device_batch(batch: dict[str, np.ndarray], keys: Iterable[str]) -> dict:
    return jax.device_put({k: batch[k] for k in keys})


def call_inputs(program: TrainProgram, padded: PaddedRows, plan: list[tuple[int, np.ndarray]],
                rates: np.ndarray, first: int) -> dict[str, np.ndarray]:
    """The inputs of the call of `program` that runs steps first, first + 1, ... of `plan`
    (padded lengths and rows, per step) with `rates` (per step): the batches stacked at the
    program's longest length (or packed into its rows), each step's branch (the first of the
    program's lengths that holds it; past the plan's end, a padding step), rate and number."""
    steps, width, micro = program.steps_per_call, max(program.lengths), program.micro_batches
    chunk = plan[first:first + steps]
    pad = steps - len(chunk)
    batches = [rows for _, rows in chunk] + [np.zeros(0, np.int64)] * pad
    if micro > 1:   # each step's micro-batches in turn, then [steps * micro, ...] -> [steps, micro, ...]
        batches = [part for rows in batches for part in micro_batch_rows(rows, program.micro_batch_size, micro)]
    if program.rows:
        inputs = padded.packed(batches, program.micro_batch_size, program.rows, width)
    else:
        inputs = padded.stacked(batches, program.micro_batch_size)
        for key in ("input_ids", "token_type_ids"):
            inputs[key] = np.ascontiguousarray(inputs[key][:, :, :width])
    if micro > 1:
        inputs = {k: v.reshape(steps, micro, *v.shape[1:]) for k, v in inputs.items()}
    inputs["branch"] = np.array([program.branch(length) for length, _ in chunk] + [len(program.lengths)] * pad,
                                np.int32)
    inputs["learning_rate"] = np.pad(rates[first:first + len(chunk)], (0, pad), constant_values=0.0)   # padding: rate 0
    inputs["step"] = np.arange(first, first + steps, dtype=np.int32)
    return inputs


def finetune(classifier: Classifier, programs: Programs, features: Features, protocol: Protocol, *,
             seed: int, pad_id: int, desc: str = "", log_every: int = 50,
             log_fn: Callable[[dict], None] | None = None, progress: bool = True,
             steps_per_call: int = STEPS_PER_CALL, padding: str = "step",
             checkpoints: SeedCheckpoints | None = None) -> tuple[Classifier, dict]:
    """Train from `classifier`; returns (the trained classifier, {"steps", "final_loss",
    "steps_per_sec"}). `padding`: "step", "call" or "packed" (TRAIN_PADDINGS). The losses are read
    from the device once, after the last step, or at a save. With `checkpoints`
    (roformer.glue.resume), training goes on from the newest state saved there, the same
    calls from there as an uninterrupted run's (the same result, test), and the state is saved
    after each call that passes a multiple of their `every` steps, and after the last."""
    total_steps = protocol.total_steps(len(features))
    # every step's rate at once, on the host: a rate computed per step by the schedule would
    # be a device computation whose value the host waits for, a sync every step
    rates = np.asarray(jax.device_get(protocol.schedule(total_steps)(np.arange(total_steps))), np.float32)
    plan = planned_train_batches(features, protocol.batch_size, protocol.max_seq_len, seed, total_steps)
    per_call = call_programs(plan, protocol, padding, steps_per_call, features.lengths)
    padded = PaddedRows.of(features, protocol.max_seq_len, pad_id)
    start_step, rows, info = 0, [], {}    # rows: logged rows read from the device (or restored)
    restored = checkpoints.restore(programs.abstract_params, programs.abstract_opt_state) if checkpoints else None
    if restored is not None and restored[0] % steps_per_call and restored[0] != total_steps:
        log.warning("%s: the state saved at step %d is not at a call's end; training from the start", desc, restored[0])
        restored = None
    if restored is not None:
        start_step, params, opt_state, data = restored
        rows, info = list(data.get("rows", [])), data.get("info", {})
        log.info("%s: resumed at step %d of %d from %s", desc, start_step, total_steps, checkpoints.directory)
    else:
        # a copy: the program donates (frees) its input params, and the caller keeps its classifier
        params = jax.device_put(classifier.params, may_alias=False)
        opt_state = programs.tx.init(params)
    compiled = {program: programs.train_steps(program)
                for first, program in zip(range(0, total_steps, steps_per_call), per_call) if first >= start_step}
    rest, base_key = classifier.rest, jax.random.key(seed)
    logged = []     # (step, losses of its call, index in them), not read yet

    def read_logged() -> list[dict]:
        fetched = jax.device_get([losses for _, losses, _ in logged])
        read = [{"step": step, "loss": float(values[index]), "learning_rate": float(rates[step - 1])}
                for (step, _, index), values in zip(logged, fetched)]
        logged.clear()
        return read

    in_flight = deque()
    start = time.perf_counter()
    # pretraining's progress: a bar on a terminal, a plain line now and then in a log
    with progress_bar(total=total_steps, initial=start_step, desc=desc, enabled=progress) as bar:
        for first, program in zip(range(0, total_steps, steps_per_call), per_call):
            if first < start_step:
                continue
            batches = call_inputs(program, padded, plan, rates, first)
            params, opt_state, losses = compiled[program](params, opt_state, rest, jax.device_put(batches), base_key)
            last = min(first + steps_per_call, total_steps)
            in_flight.append((losses, last - first))
            if len(in_flight) > CALLS_AHEAD:   # an older call: the newer ones keep the device busy
                done, steps = in_flight.popleft()
                jax.block_until_ready(done)
                bar.update(steps)              # the bar counts finished steps, not queued ones
            logged += [(step, losses, step - first - 1) for step in range(first + 1, last + 1)
                       if step % log_every == 0 or step == total_steps]
            if checkpoints and last < total_steps and checkpoints.due(first, last):
                rows += read_logged()          # before the next call takes (donates) params
                checkpoints.save(last, params, opt_state, {"rows": rows})
        while in_flight:
            done, steps = in_flight.popleft()
            jax.block_until_ready(done)
            bar.update(steps)
    rows += read_logged()     # waits for the last step
    seconds = time.perf_counter() - start
    for row in rows:
        if not math.isfinite(row["loss"]):
            raise FloatingPointError(f"{desc}: loss is {row['loss']} at step {row['step']}")
        if log_fn:
            log_fn(dict(row))
    if start_step < total_steps:
        info = {"steps": total_steps, "final_loss": rows[-1]["loss"] if rows else float("nan"),
                "steps_per_sec": round((total_steps - start_step) / max(seconds, 1e-9), 2)}
        if checkpoints:   # a run killed in a later seed restores this one instead of training it
            checkpoints.save(total_steps, params, opt_state, {"rows": rows, "info": info})
    return dataclasses.replace(classifier, params=params), info


def predict_lengths(setting: str, max_seq_len: int, platform: str | None = None) -> tuple[int, ...]:
    """The padded lengths prediction batches take (config.eval_padding, see EVAL_PADDINGS)
    on `platform` (default: jax's backend)."""
    if setting not in EVAL_PADDINGS:
        raise ConfigError(f"eval_padding must be one of {EVAL_PADDINGS}, got {setting!r}")
    if setting == "auto":
        setting = "bucket" if (platform or jax.default_backend()) == "cpu" else "full"
    return bucket_lengths(max_seq_len) if setting == "bucket" else (max_seq_len,)


def predict_shapes(features: Iterable[Features], *, batch_size: int, lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (batch, length) programs `predict` will run on each of `features`."""
    return sorted({(batch_size, length) for f in features for length, _ in eval_batches(f, batch_size, lengths)})


def predict(classifier: Classifier, programs: Programs, features: Features, *, batch_size: int,
            lengths: tuple[int, ...], pad_id: int) -> np.ndarray:
    """Predicted class ids (or scores) in the order of `features`, read from the device once;
    a batch is padded to the first of `lengths` that holds it (`predict_lengths`)."""
    params = jax.device_put(classifier.params)
    outputs = []
    for length, rows in eval_batches(features, batch_size, lengths):
        batch = _device_batch(features.batch(rows, batch_size, length, pad_id), MODEL_INPUTS)
        outputs.append((rows, programs.predict_step(batch_size, length)(params, classifier.rest, batch)))
    out = np.zeros(len(features), np.float32 if programs.regression else np.int64)
    for (rows, _), values in zip(outputs, jax.device_get([values for _, values in outputs])):
        out[rows] = values[:len(rows)]
    return out
