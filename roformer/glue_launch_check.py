"""A GLUE config checked for a TPU or GPU it does not run on: the real train and predict
programs of its tasks compiled ahead of time for one of the target's devices, on any host,
before any GLUE data is read or any checkpoint weights are loaded.

    python -m roformer.glue --config=configs/glue.py:accel=tpu --config.model.size=base \\
        --config.model.vocab_size=30522 --compile_only=v5e:4x4

Fine-tuning runs on one device (its programs are single-device: a larger target runs it no
faster), so the report is one device's: parameters, optimizer state and each program's
arguments, temporaries and peak against the device's memory, and the programs'
collectives (none, a single device exchanges nothing). A config that does not fit is refused
in one line, as pretraining's (roformer.launch_check), naming GLUE's settings. The
architecture is config.init's (read from its config file, not its weights), or with
init=none config.model's, with config.model.vocab_size (or config.vocab's size).
"""
from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from roformer import launch_check
from roformer.checkpoint_source import CheckpointSource
from roformer.data.tokenizer import load_tokenizer
from roformer.errors import ConfigError
from roformer.glue.finetune import (STEPS_PER_CALL, TRAIN_PADDINGS, Classifier, Programs, Protocol, TrainProgram,
                                    create_model, padded_form, predict_lengths)
from roformer.glue.features import row_buckets
from roformer.glue.init import InitSource, resolve_model_config
from roformer.glue.settings import check_config
from roformer.glue.tasks import TASKS, parse_task_list
from roformer.model import ModelConfig
from roformer.train.compiled import StepReport, compile_lowered, device_bytes, size_text, unfit_message


def glue_model_config(config) -> ModelConfig:
    """The architecture a GLUE run of `config` fine-tunes, without loading weights or data:
    config.init's config file, or config.model's (init=none) with its vocabulary size."""
    if not config.init or config.init.lower() == "none":
        vocab = config.model.vocab_size or (load_tokenizer(config.vocab, lowercase=config.lowercase).vocab_size
                                            if config.vocab else 0)
        if not vocab:
            raise ConfigError("--compile_only with config.init=none needs the vocabulary's size: set "
                              "--config.model.vocab_size (or --config.vocab, the tokenizer file)")
        return resolve_model_config(config.model, InitSource("none", None, None, None, None), vocab)
    source = CheckpointSource.find(config.init, config.init_step, what="config.init",
                                   missing_tokenizer_hint="; give the run's vocabulary with --config.vocab")
    architecture = source.model_config()
    return resolve_model_config(config.model, InitSource(source.kind, str(source.path), architecture, None, None),
                                architecture.vocab_size)


@dataclasses.dataclass
class TaskProgram:
    """One train program the tasks of a run share (their batch and length, their optimizer
    setting), compiled with the head of `task`, the one of them with the most labels (the
    others' programs differ only in the head's few columns)."""
    tasks: list[str]
    task: str
    protocol: Protocol
    program: TrainProgram
    padding: str


def task_programs(config, platform: str) -> list[TaskProgram]:
    """The largest train program each group of the run's tasks calls on `platform`: with
    train_padding auto, the padded form (which packed rows only shrink), all lengths of a
    step-padded program, or full rows."""
    from roformer.glue.run import trained_tasks

    setting = config.get("train_padding", "auto")
    if setting not in TRAIN_PADDINGS:
        raise ConfigError(f"train_padding must be one of {TRAIN_PADDINGS}, got {setting!r}")
    padding = padded_form(platform) if setting == "auto" else setting
    groups: dict[tuple, TaskProgram] = {}
    for name in trained_tasks(parse_task_list(config.task)):
        protocol = Protocol.from_config(config, name)
        protocol.check(name)
        if padding == "step":
            program = TrainProgram.for_protocol(protocol)
        else:
            rows = max(row_buckets(protocol.batch_size)) if padding == "packed" else 0
            program = TrainProgram(protocol.batch_size, (protocol.max_seq_len,), STEPS_PER_CALL, rows=rows)
        key = (program, protocol.update_settings)
        if key not in groups:
            groups[key] = TaskProgram([], name, protocol, program, padding)
        group = groups[key]
        group.tasks.append(name)
        if TASKS[name].num_labels > TASKS[group.task].num_labels:
            group.task = name
    return list(groups.values())


@dataclasses.dataclass
class GlueReport:
    target: launch_check.Target
    devices: int                          # the target's
    device_bytes: int
    model: ModelConfig
    param_bytes: int
    opt_bytes: int
    param_count: int
    programs: list[tuple[TaskProgram, list[StepReport]]]   # each group's train and predict programs

    @property
    def steps(self) -> list[StepReport]:
        return [step for _, steps in self.programs for step in steps]

    @property
    def peak_bytes(self) -> int:
        return max(step.peak_bytes for step in self.steps)


def compile_glue(config, target: launch_check.Target) -> GlueReport:
    """Compile the run's GLUE train and predict programs for one of `target`'s devices."""
    from roformer.model import backend
    from roformer.model.attention import check_attention_impl

    check_config(config)
    devices = launch_check.target_devices(target)
    model_cfg = glue_model_config(config)
    check_attention_impl(model_cfg, platform=target.platform)
    compiler_options = None
    if target.platform == "gpu":
        from roformer import deviceless

        compiler_options = dict(deviceless.DEFAULT_COMPILER_OPTIONS)
    groups, programs = task_programs(config, target.platform), None
    with backend.targeting(target.platform):
        reports = []
        for group in groups:
            spec = TASKS[group.task]
            model = nnx.eval_shape(lambda labels=spec.num_labels: create_model(model_cfg, labels, 0))
            programs = Programs(Classifier.split(model), group.protocol.update_settings, spec.is_regression,
                                device=devices[0])
            length = max(predict_lengths(config.get("eval_padding", "auto"), group.protocol.max_seq_len,
                                         platform=target.platform))
            steps = [compile_lowered(programs.lower_train(group.program), name="train program",
                                     compiler_options=compiler_options)[1],
                     compile_lowered(programs.lower_predict(config.eval_batch_size, length), name="predict program",
                                     compiler_options=compiler_options)[1]]
            reports.append((group, steps))
    return GlueReport(target, len(devices), launch_check.device_memory_bytes(target, devices), model_cfg,
                      device_bytes(programs.abstract_params), device_bytes(programs.abstract_opt_state),
                      sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(programs.abstract_params)), reports)


def check_fits(report: GlueReport) -> None:
    """ConfigError (one line) when the target's device cannot hold the programs."""
    train = max((steps[0] for _, steps in report.programs), key=lambda s: s.peak_bytes)
    message = unfit_message(
        report.peak_bytes, report.device_bytes, where=f"{report.target.name} ({report.target.kind})",
        state_bytes=report.param_bytes + report.opt_bytes,
        temp_bytes=max(s.memory["temp_size_in_bytes"] for s in report.steps), remat=report.model.remat,
        step="GLUE train program", temp_knob="lower batch_size or max_seq_len (per_task.<task>.* for one task)",
        state_knob="fine-tune a smaller model: GLUE runs on one device;")
    if message:
        raise ConfigError(message + f" [compiled: {train.name} {size_text(train.peak_bytes)}]")


def format_report(report: GlueReport) -> str:
    """The report as the command prints it."""
    t, m = report.target, report.model
    lines = [f"target {t.name}: GLUE fine-tunes on one device, 1 of its {report.devices} {t.platform.upper()} "
             f"{t.kind} devices, {size_text(report.device_bytes)} each; no mesh",
             f"model {report.param_count / 1e6:.0f}M parameters, hidden {m.hidden_size} x {m.num_layers} layers ({m.position}, vocab {m.vocab_size}, {m.dtype} compute, "
             f"remat {m.remat})",
             "memory per device:",
             f"  parameters       {size_text(report.param_bytes)}",
             f"  optimizer state  {size_text(report.opt_bytes)}"]
    for group, steps in report.programs:
        p = group.program
        lines.append(f"  tasks {', '.join(group.tasks)} (compiled with {group.task}'s head): batch {p.batch_size}"
                     + (f" packed into {p.rows} rows" if p.rows else "") + f" x {max(p.lengths)}, "
                     f"{p.steps_per_call} steps per call, padding {group.padding}"
                     + (f" (one program, a branch per length {list(p.lengths)})" if len(p.lengths) > 1 else ""))
        lines += [launch_check.step_memory_line(step, "    ", 17) for step in steps]
    lines.append(launch_check.fit_line(report.peak_bytes, report.device_bytes))
    lines.append("sharding: none; every parameter and the optimizer state whole on the one device")
    for group, steps in report.programs:
        for step in steps:
            kinds = ", ".join(f"{c.kind} x{c.count} ({size_text(c.sent_bytes)} sent)" for c in step.collectives.values())
            lines.append(f"collectives of the {step.name} ({group.task}): {kinds or 'none'}")
    return "\n".join(lines)


def check_target(config, target_name: str) -> str:
    """The report of `config`'s GLUE programs compiled for `target_name` (the --compile_only
    command), after refusing, in one line, programs one device cannot hold."""
    report = compile_glue(config, launch_check.parse_target(target_name))
    check_fits(report)
    return format_report(report)
