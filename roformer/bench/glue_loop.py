"""The GLUE fine-tuning loop's host cost per optimizer step, with a model so small that the
device's work is negligible: what is left of a step's time is the host's.

Times, in alternating rounds over the same planned steps (synthetic examples whose lengths
fill several padded-length buckets):
- `per-step loop`: one call per step, as the loop ran before steps_per_call (c208fa5): a
  batch assembled per step (`Features.batch`), sent with `jax.device_put`, one compiled
  program per padded length, the rate and step as NumPy scalars;
- `finetune k=K`: `roformer.glue.finetune.finetune` itself with `steps_per_call` K, its own
  steps/s (the loop, not the compilation), for each `--paddings` (step: each step padded to
  its own length, a branch per length in one program; call: a call's steps padded to their
  longest, a program per length and no branch; packed: a step's examples packed into rows of
  --max-len, a program per row count);
- `bare k=K`: the same compiled programs called with every batch already on the device: the
  floor a loop of that many steps per call can reach on this machine.
Each variant's `host_ms_step` is the CPU time of the thread that runs the loop, per step: the
host's own work (jax runs the programs on threads of its own, and the wait at the end is
not CPU time), which a loaded machine inflates far less than wall time. For `finetune` it
covers the whole call (the plan, the padded rows, the optimizer's initial state).
Then a breakdown of the host's parts, per step: assembling a batch (per step, and as one
gather of K batches), sending it, flattening the state at a call (this model's, and a base
model's state built abstractly), and a progress-bar update.
"""
from __future__ import annotations

import io
import statistics
import time
from types import SimpleNamespace

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from roformer import cli
from roformer.accelerator import ACCELERATOR_SETTINGS
from roformer.glue import finetune as finetune_lib
from roformer.glue.features import Features, PaddedRows, bucket_lengths, planned_train_batches
from roformer.model import ModelConfig

VARIANTS = ("per-step loop", "finetune", "bare")
COLUMNS = ("variant", "steps_per_call", "padding", "steps_s", "steps_s_min", "steps_s_max", "ms_step", "x_per_step_loop",
           "host_ms_step", "x_host")


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--preset", default=None, metavar="SIZE",
                   help="a model of this preset (base: what a GPU run fine-tunes) instead of the micro model "
                        "of --hidden/--layers/--vocab-size")
    command.define("--accel", default="cpu", choices=sorted(ACCELERATOR_SETTINGS),
                   help="the accelerator setting of the model (gpu: bf16 compute, no attention dropout, "
                        "the fused attention kernel)")
    command.define("--variants", many=True, choices=VARIANTS, default=list(VARIANTS),
                   help="the loops to time (per-step loop: one program per padded length, compiled apart)")
    command.define("--hidden", type=int, default=32, help="hidden size of the micro model (1 head per 16)")
    command.define("--layers", type=int, default=1)
    command.define("--vocab-size", type=int, default=1000)
    command.define("--batch", type=int, default=32)
    command.define("--max-len", type=int, default=128, help="max_seq_len (buckets 16, 32, ... up to it)")
    command.define("--steps", type=int, default=400, help="optimizer steps per timed loop")
    command.define("--steps-per-call", type=int, many=True, default=[1, 16])
    command.define("--paddings", many=True, choices=finetune_lib.TRAIN_PADDINGS[1:], default=["step"],
                   help="how finetune and bare pad a step's batch (roformer.glue.finetune.TRAIN_PADDINGS)")
    command.define("--rounds", type=int, default=3, help="alternating rounds")
    command.define("--program-size", default=None, metavar="PRESET",
                   help="also build the train program of a model of this preset (base: what a GPU run "
                        "compiles) and report its size, compile time and serialized size")


def synthetic_features(n: int, max_len: int, vocab_size: int, seed: int = 0) -> Features:
    """n single-sentence examples, lengths log-normal around 18 tokens (SST-2-like: most
    batches of 32 pad to 32 or 64, a few to 128 at max_len 128)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.9, 0.45, n).astype(int), 3, max_len)
    ids = [rng.integers(5, vocab_size, n_tokens).astype(np.int32) for n_tokens in lengths]
    return Features(ids, [np.zeros(len(x), np.int32) for x in ids], rng.integers(0, 2, n).astype(np.int32),
                    np.arange(n))


def model_config(args: SimpleNamespace) -> ModelConfig:
    """The micro model, or the --preset one, with the --accel setting."""
    if args.preset:
        return ModelConfig.from_preset(args.preset, **ACCELERATOR_SETTINGS[args.accel])
    return ModelConfig(**{"vocab_size": args.vocab_size, "hidden_size": args.hidden, "num_layers": args.layers,
                          "num_heads": max(1, args.hidden // 16), "intermediate_size": 2 * args.hidden,
                          "attention_dropout": 0.0, **ACCELERATOR_SETTINGS[args.accel]})


def protocol(args: SimpleNamespace) -> finetune_lib.Protocol:
    """The fine-tuning protocol every timed loop and program here runs."""
    return finetune_lib.Protocol(
        learning_rate=4e-5, batch_size=args.batch, num_epochs=1.0, max_steps=args.steps, warmup_fraction=0.1,
        weight_decay=0.01, max_seq_len=args.max_len, max_train_examples=0, decay="linear", b1=0.9, b2=0.98,
        eps=1e-6, clip_norm=1.0)


class Setup:
    """The classifier, its programs and one plan of `steps` steps."""

    def __init__(self, args: SimpleNamespace):
        self.protocol = protocol(args)
        config = model_config(args)
        self.features = synthetic_features(args.batch * args.steps, args.max_len, config.vocab_size)
        self.classifier = finetune_lib.Classifier.split(finetune_lib.create_model(config, 2, 0))
        self.programs = finetune_lib.Programs(self.classifier, self.protocol.update_settings, False)
        self.steps = args.steps
        self.plan = planned_train_batches(self.features, args.batch, args.max_len, 0, args.steps)
        self.rates = np.full(args.steps, 1e-5, np.float32)
        self.single = jax.jit(self.programs.single_step(), donate_argnums=(0, 1))
        self.per_length = {}
        for length in sorted({length for length, _ in self.plan}) if "per-step loop" in args.variants else ():
            batch = self.features.batch(np.zeros(0, np.int64), args.batch, length, 0)
            self.per_length[length] = self.single.lower(
                self.programs.abstract_params, self.programs.abstract_opt_state, self.programs.abstract_rest,
                {k: jax.ShapeDtypeStruct(batch[k].shape, batch[k].dtype) for k in finetune_lib.TRAIN_INPUTS},
                jax.ShapeDtypeStruct((), np.float32), jax.eval_shape(lambda: jax.random.key(0)),
                jax.ShapeDtypeStruct((), np.int32)).compile()

    def fresh_state(self):
        params = jax.device_put(self.classifier.params, may_alias=False)
        return params, self.programs.tx.init(params)

    def per_step_loop(self) -> tuple[float, float]:
        """The loop before steps_per_call: (wall, thread CPU) seconds for the plan's steps."""
        params, opt_state = self.fresh_state()
        rest, key, batch_size = self.classifier.rest, jax.random.key(0), self.protocol.batch_size
        start, thread_start = time.perf_counter(), time.thread_time()
        for step, (length, rows) in enumerate(self.plan):
            batch = self.features.batch(rows, batch_size, length, 0)
            batch = jax.device_put({k: batch[k] for k in finetune_lib.TRAIN_INPUTS})
            params, opt_state, loss = self.per_length[length](params, opt_state, rest, batch, self.rates[step], key,
                                                              np.int32(step))
        jax.block_until_ready(loss)
        return time.perf_counter() - start, time.thread_time() - thread_start

    def call_programs(self, steps_per_call: int, padding: str) -> list[finetune_lib.TrainProgram]:
        return finetune_lib.call_programs(self.plan, self.protocol, padding, steps_per_call, self.features.lengths)

    def finetune(self, steps_per_call: int, padding: str) -> tuple[float, float]:
        thread_start = time.thread_time()
        _, info = finetune_lib.finetune(self.classifier, self.programs, self.features, self.protocol, seed=0,
                                        pad_id=0, progress=False, steps_per_call=steps_per_call, padding=padding)
        return self.steps / info["steps_per_sec"], time.thread_time() - thread_start

    def call_inputs(self, steps_per_call: int, padding: str) -> list[dict]:
        """Every call's inputs of the plan, as finetune builds them (NumPy)."""
        padded = PaddedRows.of(self.features, self.protocol.max_seq_len, 0)
        return [finetune_lib.call_inputs(program, padded, self.plan, self.rates, first)
                for first, program in zip(range(0, self.steps, steps_per_call),
                                          self.call_programs(steps_per_call, padding))]

    def bare(self, steps_per_call: int, padding: str, device_calls: list[dict]) -> tuple[float, float]:
        programs = [self.programs.train_steps(p) for p in self.call_programs(steps_per_call, padding)]
        params, opt_state = self.fresh_state()
        rest, key = self.classifier.rest, jax.random.key(0)
        start, thread_start = time.perf_counter(), time.thread_time()
        for program, batches in zip(programs, device_calls):
            params, opt_state, losses = program(params, opt_state, rest, batches, key)
        jax.block_until_ready(losses)
        return time.perf_counter() - start, time.thread_time() - thread_start


def per_call_us(fn, calls: int, repeat: int = 3) -> float:
    """Median over `repeat` of the microseconds per call of `fn` run `calls` times."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def base_state_structure(update_settings: tuple):
    """A base classifier's (params, opt_state, rest) built abstractly (nothing allocated):
    the pytree a call of a base model's train program flattens."""
    model = nnx.eval_shape(lambda: finetune_lib.create_model(ModelConfig.from_preset("base"), 2, 0))
    classifier = finetune_lib.Classifier.split(model)
    programs = finetune_lib.Programs(classifier, update_settings, False)
    return programs.abstract_params, programs.abstract_opt_state, programs.abstract_rest


def breakdown(setup: Setup, steps_per_call: int) -> list[dict]:
    plan, features, batch_size = setup.plan, setup.features, setup.protocol.batch_size
    length, rows = plan[len(plan) // 2]
    one = features.batch(rows, batch_size, length, 0)
    one = {k: one[k] for k in finetune_lib.TRAIN_INPUTS}
    program = finetune_lib.TrainProgram.for_protocol(setup.protocol, steps_per_call)
    padded = PaddedRows.of(features, max(program.lengths), 0)
    chunk = [r for _, r in plan[:steps_per_call]]
    stacked = padded.stacked(chunk, batch_size)
    params, opt_state = setup.fresh_state()
    state = (params, opt_state, setup.classifier.rest)
    base_state = base_state_structure(setup.protocol.update_settings)
    bar = tqdm(total=10 ** 9, file=io.StringIO(), mininterval=0.1)
    k = steps_per_call
    rows_out = [
        ("batch assembly: Features.batch (per step)", per_call_us(lambda: features.batch(rows, batch_size, length, 0), 200), 1),
        (f"batch assembly: PaddedRows.stacked of {k} batches", per_call_us(lambda: padded.stacked(chunk, batch_size), 50), k),
        ("device_put of one step's batch", per_call_us(lambda: jax.block_until_ready(jax.device_put(one)), 200), 1),
        (f"device_put of {k} stacked batches", per_call_us(lambda: jax.block_until_ready(jax.device_put(stacked)), 50), k),
        (f"flatten (params, opt_state, rest), this model: {len(jax.tree.leaves(state))} leaves",
         per_call_us(lambda: jax.tree.flatten(state), 500), 1),
        (f"flatten (params, opt_state, rest), base model: {len(jax.tree.leaves(base_state))} leaves",
         per_call_us(lambda: jax.tree.flatten(base_state), 200), 1),
        ("tqdm update (bar enabled)", per_call_us(lambda: bar.update(1), 2000), 1),
    ]
    bar.close()
    return [{"part": name, "us_per_call": us, "steps_per_call": per, "us_per_step": us / per}
            for name, us, per in rows_out]


def train_program_size(preset: str, args: SimpleNamespace) -> list[dict]:
    """The train programs a fine-tuning run of a `preset` classifier compiles (one call of
    `steps_per_call` steps; padding `step`: one program, every padded length a branch;
    `call`: one program per padded length; `packed`: the program of batch/4 rows of the
    longest length): each one's StableHLO lines, seconds to trace and
    lower, to compile, and the serialized executable's size (what the program store keeps
    and a warm run loads)."""
    from jax.experimental import serialize_executable

    config = ModelConfig.from_preset(preset, attention_dropout=0.0)
    classifier = finetune_lib.Classifier.split(finetune_lib.create_model(config, 2, 0))
    programs = finetune_lib.Programs(classifier, protocol(args).update_settings, False)
    rows = []
    lengths = bucket_lengths(args.max_len)
    forms = {"step": [(lengths, 0)], "call": [((n,), 0) for n in lengths],
             "packed": [((args.max_len,), max(1, args.batch // 4))]}
    shapes = [(k, padding, *form) for k in args.steps_per_call for padding in args.paddings for form in forms[padding]]
    for k, padding, program_lengths, packed_rows in shapes:
        program = finetune_lib.TrainProgram(args.batch, program_lengths, k, packed_rows)
        start = time.perf_counter()
        lowered = programs.lower_train(program)
        traced = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
        serialized, _, _ = serialize_executable.serialize(compiled)
        rows.append({"preset": preset, "steps_per_call": k, "padding": padding, "lengths": list(program.lengths),
                     "rows": program.rows or args.batch,
                     "stablehlo_lines": lowered.as_text().count("\n"), "trace_lower_s": traced - start,
                     "compile_s": done - traced, "serialized_mib": len(serialized) / 2 ** 20})
    return rows


def run(args: SimpleNamespace) -> dict:
    setup = Setup(args)
    shapes = [(k, padding) for k in args.steps_per_call for padding in args.paddings]
    setup.programs.prepare({p for shape in shapes for p in setup.call_programs(*shape)}, [])   # outside the timing
    chosen = set(args.variants)
    device_calls = ({shape: [jax.device_put(c) for c in setup.call_inputs(*shape)] for shape in shapes}
                    if "bare" in chosen else {})
    variants = {("per-step loop", 1, "step"): setup.per_step_loop} if "per-step loop" in chosen else {}
    for shape in shapes:
        if "finetune" in chosen:
            variants[("finetune", *shape)] = lambda shape=shape: setup.finetune(*shape)
        if "bare" in chosen:
            variants[("bare", *shape)] = lambda shape=shape: setup.bare(*shape, device_calls[shape])
    for fn in variants.values():      # warm up (allocations, first calls)
        fn()
    times = {key: [] for key in variants}
    names = list(variants)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for key in names[shift:] + names[:shift]:
            times[key].append(variants[key]())
    reference = times.get(("per-step loop", 1, "step"))
    rows = []
    for (name, k, padding), measured in times.items():
        seconds, thread = [wall for wall, _ in measured], [cpu for _, cpu in measured]
        rates = [setup.steps / s for s in seconds]
        row = {"variant": name, "steps_per_call": k, "padding": padding, "steps_s": statistics.median(rates),
               "steps_s_min": min(rates), "steps_s_max": max(rates),
               "ms_step": statistics.median(seconds) / setup.steps * 1e3,
               "host_ms_step": statistics.median(thread) / setup.steps * 1e3}
        if reference:
            row["x_per_step_loop"] = statistics.median(ref[0] / wall for ref, wall in zip(reference, seconds))
            row["x_host"] = statistics.median(ref[1] / cpu for ref, cpu in zip(reference, thread))
        rows.append(row)
    parts = breakdown(setup, max(args.steps_per_call))
    lengths = sorted({length for length, _ in setup.plan})
    tables = {"host time per step, by part": {"rows": parts}}
    if args.program_size:
        tables[f"train program, {args.program_size}"] = {"rows": train_program_size(args.program_size, args)}
    return {"rows": rows, "columns": COLUMNS, "tables": tables,
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "notes": [f"model: {args.preset or 'micro'}, accel={args.accel} setting; "
                      f"{setup.steps} steps of batch {args.batch}, padded lengths {lengths}"
                      + "".join(f"; {padding} programs (length, rows): "
                                + ", ".join(f"{p.lengths[-1]}x{p.rows or p.batch_size}"
                                            for p in sorted(set(setup.call_programs(k, padding)),
                                                            key=lambda p: (p.lengths, p.rows)))
                                for k, padding in shapes if padding != "step")
                      + ("; x_per_step_loop, x_host: medians over rounds of the per-step loop's wall (host) time "
                         "over this variant's" if reference else "")]}
