"""Position-scheme ablation in one command, resumable, with a report.

    python -m roformer.ablate --config=configs/ablation.py --workdir=DIR

For every pretraining seed and every scheme in `config.schemes`: MLM pretraining (an
ordinary pretrain workdir), length-extrapolation evaluation of the pretrained model, and
GLUE fine-tuning (an ordinary GLUE workdir). With `extension.enabled`, the pretrained
models of `extension.scheme` then continue pretraining at `extension.factor` times the
length under each of `extension.methods` (plain extrapolation, position interpolation,
NTK, YaRN, a larger RoPE base), evaluated at that length after every few steps. Layout:

    pretrain/<scheme>/seed<k>/        `tensorboard --logdir DIR/pretrain` shows them side by side
    glue/<scheme>/seed<k>/
    extension/<method>/seed<k>/
    ablation_state.json               per run and stage: done/failed, config fingerprint, results
    errors/<run>.<stage>.txt          traceback of a failed stage
    ablation.json, ablation.md, loss_curves.png, extrapolation.png, extension.png

Every scheme of one seed gets the same `config.pretrain` (data, data order, masking,
initialisation of the shared parameters, optimiser, budget); only the model keys of
the scheme's config file are applied on top. The seeds run in turn (every scheme of
seed 0 first), so an interrupted ablation already compares all schemes; the context
extension runs once every seed's pretraining is done. Re-running
skips stages that finished with the same config, resumes interrupted training from its
checkpoints, and retries failed stages. A failing stage is recorded (traceback in
DIR/errors/) and the other runs still go ahead. With `config.parallel` = K > 1 (CPU hosts)
the runs go K at a time, each in a process of its own with a core's share of XLA:CPU threads
(roformer.parallel_runs; output in DIR/logs/), with the same workdirs, records and resume.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import ml_collections

from roformer import report
from roformer.files import write_text_atomic
from roformer.train.metrics import read_metrics
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.ablate")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Ablation arms that are not a position scheme of their own: a config file's variant.
VARIANT_CONFIG_FILES = {"rope_linear": "rotary_linear"}
RUN_STAGES = ("pretrain", "extrapolation", "glue")
EXTENSION_STAGES = ("extension", "extension_eval")
STATE_FILE = "ablation_state.json"


class Preempted(Exception):
    """Training saved a checkpoint on SIGTERM: stop the ablation, resume it next run."""


# --------------------------------------------------------------------------- configs


def split_list(value: str) -> list[str]:
    return [item.strip() for item in str(value).split(",") if item.strip()]


def load_config_file(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of configs/<name>.py (the repo root goes on sys.path for files
    such as configs/ablation.py that import `configs.base`)."""
    path = CONFIG_DIR / f"{name}.py"
    if not path.exists():
        raise ValueError(f"no config file {path}")
    if str(CONFIG_DIR.parent) not in sys.path:
        sys.path.insert(0, str(CONFIG_DIR.parent))
    spec = importlib.util.spec_from_file_location(f"configs.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def scheme_config_file(scheme: str) -> str:
    """The pretraining config file of an ablation arm: a position scheme's registry name
    (learned, rope, ...), a variant (rope_linear) or a config file name (absolute, ...)."""
    from roformer.model.positions import POSITION_SCHEMES

    if scheme in POSITION_SCHEMES:
        return POSITION_SCHEMES[scheme].config_file
    if scheme in VARIANT_CONFIG_FILES:
        return VARIANT_CONFIG_FILES[scheme]
    path = CONFIG_DIR / f"{scheme}.py"
    if path.exists() and scheme not in ("base", "ablation", "glue"):
        return scheme
    known = sorted(POSITION_SCHEMES) + sorted(VARIANT_CONFIG_FILES)
    raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(known)} "
                     f"or a pretraining config file in {CONFIG_DIR}")


def scheme_model_keys(scheme: str) -> dict[str, Any]:
    """The model keys a scheme's config file sets differently from configs/base.py."""
    base_model = load_config_file("base").model.to_dict()
    scheme_model = load_config_file(scheme_config_file(scheme)).model.to_dict()
    return {k: v for k, v in scheme_model.items() if k != "size" and base_model.get(k) != v}


def pretrain_steps(config: ml_collections.ConfigDict) -> int:
    """The shared budget in optimizer steps (budget_tokens wins when > 0)."""
    train = config.pretrain.train
    if config.budget_tokens > 0:
        return math.ceil(config.budget_tokens / (train.batch_size * train.seq_len))
    return int(train.steps)


def parse_scheme_values(value: str, key: str, kind: type) -> dict[str, Any]:
    """'rope=5,learned=3' -> {'rope': 5, 'learned': 3} (`key` names the setting in errors)."""
    out = {}
    for item in split_list(value):
        scheme, sep, text = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[scheme.strip()] = kind(text)
        except ValueError:
            raise ValueError(f"config.{key}: item {item!r} is not scheme={kind.__name__}") from None
    return out


def scheme_seeds(config: ml_collections.ConfigDict, scheme: str) -> int:
    """How many pretraining seeds (0, 1, ...) `scheme` runs: config.scheme_seeds, else config.seeds."""
    return parse_scheme_values(config.get("scheme_seeds", ""), "scheme_seeds", int).get(scheme, config.seeds)


def planned_runs(config: ml_collections.ConfigDict) -> list[tuple[str, int]]:
    """(scheme, seed) of every pretraining run, every scheme of seed 0 first: an interrupted
    ablation already compares all schemes."""
    schemes = split_list(config.schemes)
    most = max([scheme_seeds(config, s) for s in schemes], default=0)
    return [(scheme, seed) for seed in range(most) for scheme in schemes if seed < scheme_seeds(config, scheme)]


def scheme_pretrain_config(config: ml_collections.ConfigDict, scheme: str, seed: int = 0
                           ) -> ml_collections.ConfigDict:
    """config.pretrain with the scheme's model keys and learning rate (config.scheme_learning_rates),
    the shared step budget and the seed."""
    cfg = ml_collections.ConfigDict(config.pretrain.to_dict())
    for key, value in scheme_model_keys(scheme).items():
        cfg.model[key] = value
    rates = parse_scheme_values(config.get("scheme_learning_rates", ""), "scheme_learning_rates", float)
    if scheme in rates:
        cfg.train.learning_rate = rates[scheme]
    cfg.train.steps = pretrain_steps(config)
    cfg.train.seed = int(seed)
    if cfg.model.get("max_position_embeddings") is None:
        # Size the learned table to the pretraining length, so "beyond the table"
        # is exactly "beyond what was trained" in the extrapolation evaluation.
        cfg.model.max_position_embeddings = cfg.train.seq_len
    return cfg


# Context-extension methods: the model keys each sets for a run at `factor` x the length.
EXTENSION_METHODS = ("none", "linear", "ntk", "yarn", "base")


def extension_model_keys(method: str, ext: ml_collections.ConfigDict, seq_len: int) -> dict[str, Any]:
    if method == "none":        # plain extrapolation: positions simply go further
        return {}
    if method == "base":        # a larger rotary base (Llama 3 style), no scaling
        return {"rope_base": float(ext.base)}
    return {"rope_scaling": method, "rope_scaling_factor": float(ext.factor),
            "rope_original_max_len": int(seq_len)}


def extension_pretrain_config(config: ml_collections.ConfigDict, method: str, seed: int,
                              init_from: Path) -> ml_collections.ConfigDict:
    """The extension run: the scheme's pretraining config at factor x the length (same tokens
    per step), warm-started from its pretrained model, with the method's RoPE settings."""
    ext = config.extension
    cfg = scheme_pretrain_config(config, ext.scheme, seed)
    seq_len = cfg.train.seq_len
    cfg.train.seq_len = seq_len * int(ext.factor)
    cfg.train.batch_size = cfg.train.batch_size // int(ext.factor)
    cfg.train.steps = int(ext.steps)
    cfg.train.learning_rate = float(ext.learning_rate)
    cfg.train.warmup_steps = int(ext.warmup_steps)
    cfg.train.decay_steps = 0
    cfg.train.eval_every = int(ext.eval_every)
    # The measurement is extension_eval on the extrapolation windows; the loop's own packed
    # held-out evaluation is kept small.
    cfg.train.eval_batches = max(1, cfg.train.eval_batches // int(ext.factor))
    cfg.train.eval_shuffled = False
    cfg.train.checkpoint_every = int(ext.eval_every)
    cfg.train.keep_checkpoints = int(ext.steps) // int(ext.eval_every) + 2   # every one is evaluated
    cfg.train.init_from = str(init_from)
    cfg.train.init_step = -1
    for key, value in extension_model_keys(method, ext, seq_len).items():
        cfg.model[key] = value
    return cfg


def extension_seeds(config: ml_collections.ConfigDict) -> int:
    """How many pretraining seeds (0, 1, ...) the context extension continues from."""
    return int(config.extension.seeds) or int(config.seeds)


def scheme_glue_config(config: ml_collections.ConfigDict, pretrain_workdir: Path) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(config.glue.to_dict())
    cfg.init = str(pretrain_workdir)
    return cfg


def validate(config: ml_collections.ConfigDict) -> None:
    """Every setting the runs depend on, checked before anything trains (one error naming
    all problems)."""
    from roformer.extrapolation import SCALINGS
    from roformer.glue.tasks import parse_task_list
    from roformer.model.positions import POSITION_SCHEMES

    problems = []
    schemes = split_list(config.schemes)
    if not schemes:
        problems.append("config.schemes is empty; list at least one scheme")
    if len(set(schemes)) != len(schemes):
        problems.append(f"config.schemes lists a scheme twice: {config.schemes!r}")
    for scheme in schemes:
        try:
            scheme_pretrain_config(config, scheme)
        except ValueError as error:
            problems.append(str(error))
    if not isinstance(config.seeds, int) or isinstance(config.seeds, bool) or config.seeds < 1:
        problems.append(f"config.seeds={config.seeds!r}: give the number of pretraining seeds (>= 1)")
    for key, kind in (("scheme_seeds", int), ("scheme_learning_rates", float)):
        try:
            values = parse_scheme_values(config.get(key, ""), key, kind)
        except ValueError as error:
            problems.append(str(error))
            continue
        if sorted(set(values) - set(schemes)):
            problems.append(f"config.{key} names {sorted(set(values) - set(schemes))}, not in config.schemes "
                            f"{schemes}")
        if any(v <= 0 for v in values.values()):
            problems.append(f"config.{key}={config.get(key)!r}: every value must be > 0")
    problems += _parallel_problems(config.parallel)
    if config.reference not in schemes:
        problems.append(f"config.reference={config.reference!r} is not one of config.schemes {schemes}")
    factors = split_list(config.extrapolation.factors)
    if not factors or not all(f.isdigit() and int(f) >= 1 for f in factors) or "1" not in factors:
        problems.append(f"extrapolation.factors={config.extrapolation.factors!r}: comma list of whole "
                        "multiples of the pretraining length, including 1")
    unknown = sorted(set(split_list(config.extrapolation.scalings)) - set(SCALINGS))
    if unknown:
        problems.append(f"extrapolation.scalings: unknown {unknown}; choose from {', '.join(SCALINGS)}")
    try:
        parse_task_list(config.glue.task) if split_list(config.glue.task) else None
    except ValueError as error:
        problems.append(f"glue.task: {error}")
    ext = config.extension
    if ext.enabled:
        methods = split_list(ext.methods)
        unknown = sorted(set(methods) - set(EXTENSION_METHODS))
        if not methods or unknown:
            problems.append(f"extension.methods={ext.methods!r}: choose from {', '.join(EXTENSION_METHODS)}")
        if ext.scheme not in schemes:
            problems.append(f"extension.scheme={ext.scheme!r} is not one of config.schemes {schemes}")
        else:
            position = scheme_pretrain_config(config, ext.scheme).model.position
            if not POSITION_SCHEMES[position].rope_scaling:
                problems.append(f"extension.scheme={ext.scheme!r} (position {position!r}) has no rotary "
                                "scaling to extend with; use a rotary scheme")
        if ext.factor < 2 or config.pretrain.train.batch_size % ext.factor:
            problems.append(f"extension.factor={ext.factor}: must be >= 2 and divide pretrain.train.batch_size="
                            f"{config.pretrain.train.batch_size} (the extension keeps the tokens per step)")
        if str(ext.factor) not in factors:
            problems.append(f"extension.factor={ext.factor} must be one of extrapolation.factors "
                            f"{config.extrapolation.factors!r} (its step-0 loss is that column)")
        if not isinstance(ext.seeds, int) or not 0 <= ext.seeds <= config.seeds:
            problems.append(f"extension.seeds={ext.seeds!r}: how many of the {config.seeds} pretraining seeds "
                            "to extend (0 = all)")
        if ext.steps < 1 or ext.eval_every < 1 or ext.steps % ext.eval_every:
            problems.append(f"extension.steps={ext.steps} must be a positive multiple of "
                            f"extension.eval_every={ext.eval_every}")
    if problems:
        raise ValueError("ablation config: " + "; ".join(problems))


def _parallel_problems(parallel: Any) -> list[str]:
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        return [f"config.parallel={parallel!r}: give how many runs train at once (>= 1)"]
    if parallel == 1:
        return []
    from roformer import parallel_runs
    from roformer.host_memory import cpu_only

    if not cpu_only():
        return [f"config.parallel={parallel}: runs side by side share a CPU host's cores; with an "
                "accelerator, run one at a time (or set JAX_PLATFORMS=cpu)"]
    try:
        parallel_runs.core_slots(parallel)
    except ValueError as error:
        return [f"config.parallel={parallel}: {error}"]
    return []


# Train settings that watch a run rather than decide what it computes: changing them never
# reruns a finished stage (a guard that fires stops the run, which is then not done anyway).
WATCH_ONLY_TRAIN_KEYS = ("progress_bar", "eval_attention_stats")
WATCH_ONLY_TRAIN_PREFIXES = ("divergence_",)


def _fingerprinted(part: Any) -> Any:
    if not isinstance(part, ml_collections.ConfigDict):
        return part
    data = part.to_dict()
    train = data.get("train")
    if isinstance(train, dict):
        data["train"] = {k: v for k, v in train.items()
                         if k not in WATCH_ONLY_TRAIN_KEYS and not k.startswith(WATCH_ONLY_TRAIN_PREFIXES)}
    return data


def fingerprint(*parts: Any) -> str:
    """Stable hash of JSON-able parts: a stage reruns when its inputs change."""
    text = json.dumps([_fingerprinted(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- state


class AblationState:
    """`DIR/ablation_state.json`: per run and stage, status, fingerprint, result."""

    def __init__(self, workdir: Path, path: Path | None = None):
        self.path = path or workdir / STATE_FILE
        self.data: dict[str, dict[str, dict]] = (
            json.loads(self.path.read_text()) if self.path.exists() else {})

    def get(self, run: str, stage: str) -> dict:
        return self.data.get(run, {}).get(stage, {})

    def is_done(self, run: str, stage: str, fp: str) -> bool:
        record = self.get(run, stage)
        return record.get("status") == "done" and record.get("fingerprint") == fp

    def set(self, run: str, stage: str, record: dict) -> None:
        self.data.setdefault(run, {})[stage] = record
        if not _is_main_process():  # every process keeps the same state; one writes it
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)


# --------------------------------------------------------------------------- stages


def _train(cfg: ml_collections.ConfigDict, workdir: Path) -> dict:
    from roformer.train import train_and_evaluate

    summary = train_and_evaluate(cfg, workdir)
    if summary["preempted"]:
        raise Preempted(f"{workdir} preempted at step {summary['final_step']}")
    if summary["final_step"] < cfg.train.steps:
        raise RuntimeError(f"training stopped at step {summary['final_step']} of {cfg.train.steps}")
    return {"steps": summary["final_step"]}


def _run_glue(cfg: ml_collections.ConfigDict, workdir: Path) -> dict:
    from roformer.glue import run_glue

    run_glue(cfg, str(workdir))
    return {}


def _run_extrapolation(config: ml_collections.ConfigDict, pretrain_cfg: ml_collections.ConfigDict,
                       pretrain_workdir: Path) -> dict:
    from roformer import extrapolation
    from roformer.data import DataConfig

    ext = config.extrapolation
    return extrapolation.evaluate_workdir(
        pretrain_workdir, DataConfig.from_mapping(pretrain_cfg.data), seq_len=pretrain_cfg.train.seq_len,
        factors=[int(f) for f in split_list(ext.factors)], scalings=split_list(ext.scalings),
        num_docs=ext.num_docs, batch_size=ext.batch_size, seed=pretrain_cfg.train.seed)


def _run_extension_eval(config: ml_collections.ConfigDict, pretrain_cfg: ml_collections.ConfigDict,
                        extension_workdir: Path) -> dict:
    """Held-out loss at factor x the length after every saved extension step, on the same
    windows as the extrapolation table (so step 0 is that table's column)."""
    from roformer import extrapolation
    from roformer.data import DataConfig

    ext = config.extrapolation
    return extrapolation.evaluate_checkpoints(
        extension_workdir, DataConfig.from_mapping(pretrain_cfg.data), seq_len=pretrain_cfg.train.seq_len,
        factors=[int(f) for f in split_list(ext.factors)], factor=int(config.extension.factor),
        num_docs=ext.num_docs, batch_size=ext.batch_size, seed=pretrain_cfg.train.seed)


# Stage runners are looked up here at call time, so tests can swap in fast fakes.
STAGE_RUNNERS: dict[str, Callable] = {
    "pretrain": _train, "extrapolation": _run_extrapolation, "glue": _run_glue,
    "extension": _train, "extension_eval": _run_extension_eval,
}


def _is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


def run_ablation(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Run (or resume) the whole ablation in `workdir` and write the report; returns it.
    A workdir another live run is using is refused (roformer.workdir_lock); the stages'
    own runs lock their sub-workdirs."""
    validate(config)
    with workdir_lock(workdir):
        return _run_ablation(config, Path(workdir).resolve())


def _run_ablation(config: ml_collections.ConfigDict, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    state = AblationState(workdir)
    if _is_main_process():
        (workdir / "ablation_config.json").write_text(config.to_json_best_effort(indent=2) + "\n")

    started = time.time()
    vocab = pin_vocabulary(config, workdir)
    result = None
    try:
        # config.parallel > 1: every run in a process of its own, that many at once.
        run_jobs = _run_side_by_side if config.parallel > 1 else _run_in_turn
        result = run_jobs(config, workdir, state, vocab, _scheme_jobs(config))
        if config.extension.enabled:   # after the comparison itself, which it builds on
            result = run_jobs(config, workdir, state, vocab, _extension_jobs(config))
    except Preempted as error:
        log.warning("%s; stopping the ablation (re-run the command to resume)", error)
        result = None   # the runs done before the preemption are in the state, not yet in a report
    log.info("ablation session took %.0f s", time.time() - started)
    return result if result is not None else _write_report(config, workdir, state)


PINNED_TOKENIZER = "tokenizer.json"


def pin_vocabulary(config: ml_collections.ConfigDict, workdir: Path) -> str:
    """The one vocabulary every run of the ablation reads: pretrain.data.vocab when set, else
    WORKDIR/tokenizer.json, taken from a run that already trained (an older workdir) or from
    the data pipeline on first use. WordPiece training is not deterministic (hash-map order
    inside `tokenizers`, huggingface/tokenizers#1794) and its cache is keyed by the files'
    paths, sizes and mtimes, so without a pin a resumed ablation on a new machine, or after
    the text was re-copied, would give its remaining runs a different vocabulary."""
    if config.pretrain.data.vocab:
        return str(config.pretrain.data.vocab)
    pinned = workdir / PINNED_TOKENIZER
    if _is_main_process() and not pinned.is_file():
        from roformer.train.checkpoint import PretrainWorkdir

        trained = [PretrainWorkdir(p).tokenizer_file for p in sorted((workdir / "pretrain").glob("*/seed*"))
                   if PretrainWorkdir.holds_run(p)]
        trained = [f for f in trained if f.is_file()]
        if trained:
            text = trained[0].read_text()
        else:
            from roformer.data import DataConfig
            from roformer.data.pipeline import corpus_tokenizer

            text = corpus_tokenizer(DataConfig.from_mapping(config.pretrain.data)).tokenizer.to_str()
        write_text_atomic(pinned, text)
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("ablation vocabulary pinned")
    return str(pinned)


def _scheme_stages(config, workdir: Path, scheme: str, seed: int, vocab: str
                   ) -> list[tuple[str, str, Callable]]:
    """(stage, fingerprint, call) for one scheme and seed."""
    pretrain_cfg = scheme_pretrain_config(config, scheme, seed)
    pretrain_dir = workdir / "pretrain" / scheme / f"seed{seed}"
    # The pinned vocabulary is a property of the workdir, not of the config: fingerprints
    # stay those of the config as written, so moving the workdir resumes it.
    fp = fingerprint(pretrain_cfg)
    pretrain_cfg.data.vocab = vocab
    stages = [
        ("pretrain", fp, lambda: STAGE_RUNNERS["pretrain"](pretrain_cfg, pretrain_dir)),
        ("extrapolation", fingerprint(fp, config.extrapolation),
         lambda: STAGE_RUNNERS["extrapolation"](config, pretrain_cfg, pretrain_dir)),
    ]
    if split_list(config.glue.task):
        stages.append(("glue", fingerprint(fp, config.glue), lambda: STAGE_RUNNERS["glue"](
            scheme_glue_config(config, pretrain_dir), workdir / "glue" / scheme / f"seed{seed}")))
    return stages


def _extension_stages(config, workdir: Path, method: str, seed: int, vocab: str
                      ) -> list[tuple[str, str, Callable]]:
    source = workdir / "pretrain" / config.extension.scheme / f"seed{seed}"
    ext_cfg = extension_pretrain_config(config, method, seed, source)
    pretrain_cfg = scheme_pretrain_config(config, config.extension.scheme, seed)
    ext_dir = workdir / "extension" / method / f"seed{seed}"
    fp = fingerprint(fingerprint(pretrain_cfg), ext_cfg)
    ext_cfg.data.vocab = pretrain_cfg.data.vocab = vocab
    return [
        ("extension", fp, lambda: STAGE_RUNNERS["extension"](ext_cfg, ext_dir)),
        ("extension_eval", fingerprint(fp, config.extrapolation),
         lambda: STAGE_RUNNERS["extension_eval"](config, pretrain_cfg, ext_dir)),
    ]


class _Job(NamedTuple):
    """One run of the ablation: its name in the state, and what builds its stages."""
    run: str          # <scheme>/seed<k> or extension/<method>/seed<k>
    kind: str         # "scheme" or "extension"
    key: str          # the scheme or the extension method
    seed: int


def _scheme_jobs(config) -> list[_Job]:
    return [_Job(f"{scheme}/seed{seed}", "scheme", scheme, seed) for scheme, seed in planned_runs(config)]


def _extension_jobs(config) -> list[_Job]:
    return [_Job(f"extension/{method}/seed{seed}", "extension", method, seed)
            for seed in range(extension_seeds(config)) for method in split_list(config.extension.methods)]


def _job_stages(config, workdir: Path, job: _Job, vocab: str) -> list[tuple[str, str, Callable]]:
    make = _scheme_stages if job.kind == "scheme" else _extension_stages
    return make(config, workdir, job.key, job.seed, vocab)


def _run_in_turn(config, workdir: Path, state: AblationState, vocab: str, jobs: list[_Job]) -> dict | None:
    result = None
    for job in jobs:
        _run_stages(state, workdir, job.run, _job_stages(config, workdir, job, vocab))
        result = _write_report(config, workdir, state)   # readable while the next run trains
    return result


# config.parallel > 1: a run's job file and its own state (merged into DIR/ablation_state.json
# when its process ends, or by the next session if this one was killed) live here, its output
# in DIR/logs/<run>.log.
JOBS_DIR = "parallel"
LOGS_DIR = "logs"
PREEMPTED_EXIT = 75   # a run's process saved a checkpoint on SIGTERM (EX_TEMPFAIL)
POLL_S = 0.2


def _run_side_by_side(config, workdir: Path, state: AblationState, vocab: str, jobs: list[_Job]) -> dict | None:
    """Run the jobs config.parallel at a time, each in a process of its own with its share of
    the cores (roformer.parallel_runs), in the order given; the report is rewritten as each ends. On
    SIGTERM every running run saves a checkpoint and Preempted is raised once they have."""
    import signal
    import threading

    from roformer import parallel_runs

    _merge_job_states(state, workdir)
    slots = parallel_runs.core_slots(int(config.parallel))
    pending = []
    for job in jobs:
        stages = _job_stages(config, workdir, job, vocab)
        if all(state.is_done(job.run, stage, fp) for stage, fp, _ in stages):
            log.info("%s: already done, skipping", job.run)
        else:
            pending.append((job, stages))
    running: dict[int, tuple[Any, _Job]] = {}   # slot -> (process, job)
    stop: list[str] = []                        # why no further run starts

    def preempt(reason: str) -> None:
        if not stop:
            stop.append(reason)
            for process, _ in running.values():
                process.send_signal(signal.SIGTERM)   # each saves a checkpoint and exits

    handled = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: preempt("SIGTERM received")) if handled else None
    result = None
    try:
        while running or (pending and not stop):
            for slot, cores in enumerate(slots):
                if slot not in running and pending and not stop:
                    job, stages = pending.pop(0)
                    running[slot] = (_start_job(config, workdir, state, vocab, job, stages, cores), job)
            time.sleep(POLL_S)
            for slot, (process, job) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[slot]
                _merge_job_states(state, workdir, job.run)
                if process.returncode == PREEMPTED_EXIT:
                    preempt(f"{job.run} preempted")
                elif process.returncode != 0 and not (stop and process.returncode == -signal.SIGTERM):
                    _record_crash(state, workdir, job, _job_stages(config, workdir, job, vocab),
                                  process.returncode)
                log.info("%s: process ended (status %d)", job.run, process.returncode)
                result = _write_report(config, workdir, state)
    finally:
        for process, job in running.values():   # only after an error here: let them save and stop
            process.terminate()
            process.wait()
            _merge_job_states(state, workdir, job.run)
        if handled:
            signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(OSError):   # left only while runs are unmerged
            (workdir / JOBS_DIR).rmdir()
    if stop:
        raise Preempted(stop[0])
    return result


def _start_job(config, workdir: Path, state: AblationState, vocab: str, job: _Job,
               stages: list[tuple[str, str, Callable]], cores: list[int]):
    import subprocess

    from roformer import parallel_runs

    name = _error_name(job.run)
    jobs_dir, logs_dir = workdir / JOBS_DIR, workdir / LOGS_DIR
    jobs_dir.mkdir(exist_ok=True)
    logs_dir.mkdir(exist_ok=True)
    job_state = jobs_dir / f"{name}.state.json"
    _write_json(job_state, {job.run: state.data.get(job.run, {})})
    spec = {"config": config.to_dict(), "workdir": str(workdir), "job": list(job), "vocab": vocab,
            "state": str(job_state), "fingerprints": [fp for _, fp, _ in stages]}
    _write_json(jobs_dir / f"{name}.job.json", spec)
    log.info("%s: starting in a process of its own (log: %s)", job.run, logs_dir / f"{name}.log")
    with open(logs_dir / f"{name}.log", "a") as out:
        return subprocess.Popen([sys.executable, "-m", "roformer.parallel_runs", str(jobs_dir / f"{name}.job.json")],
                                env=parallel_runs.child_env(cores), stdout=out, stderr=subprocess.STDOUT)


def _write_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def _merge_job_states(state: AblationState, workdir: Path, run: str | None = None) -> None:
    """Take the records a run's process wrote (all runs' when `run` is None: what a killed
    session left) into the ablation's state, and remove its job files."""
    jobs_dir = workdir / JOBS_DIR
    names = [f"{_error_name(run)}.state.json"] if run else sorted(p.name for p in jobs_dir.glob("*.state.json"))
    for name in names:
        path = jobs_dir / name
        if path.exists():
            for run_name, records in json.loads(path.read_text()).items():
                for stage, record in records.items():
                    if record != state.get(run_name, stage):
                        state.set(run_name, stage, record)
            path.unlink()
        (jobs_dir / name.replace(".state.json", ".job.json")).unlink(missing_ok=True)


def _record_crash(state: AblationState, workdir: Path, job: _Job, stages, returncode: int) -> None:
    """A run's process that died without recording its stage (killed, out of memory): the
    stage it was in is failed, so the report says so and the next session retries it."""
    for stage, fp, _ in stages:
        if state.get(job.run, stage).get("status") == "failed":
            return
        if not state.is_done(job.run, stage, fp):
            import signal

            log_file = workdir / LOGS_DIR / f"{_error_name(job.run)}.log"
            how = (f"was killed by {signal.Signals(-returncode).name}" if returncode < 0
                   else f"exited with status {returncode}")
            _record_failure(state, workdir, job.run, stage, fp, RuntimeError(
                f"the run's process {how}; its output is in {log_file}"))
            return


def run_job_file(path: str | Path) -> int:
    """In a run's own process (python -m roformer.parallel_runs JOB.json): the run's stages
    that are not done yet, recorded in the job's own state file. Returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("roformer").setLevel(logging.INFO)
    spec = json.loads(Path(path).read_text())
    config = ml_collections.ConfigDict(spec["config"])
    workdir, job = Path(spec["workdir"]), _Job(*spec["job"])
    stages = _job_stages(config, workdir, job, spec["vocab"])
    if [fp for _, fp, _ in stages] != spec["fingerprints"]:
        raise RuntimeError(f"{path}: the config read back does not give the stages' fingerprints")
    try:
        _run_stages(AblationState(workdir, Path(spec["state"])), workdir, job.run, stages)
    except Preempted as error:
        log.warning("%s", error)
        return PREEMPTED_EXIT
    return 0


def _run_stages(state: AblationState, workdir: Path, run: str, stages: list[tuple[str, str, Callable]]) -> None:
    """Run the stages of one run that are not done yet; failures are recorded, not raised.
    A failed first stage (training) skips the rest, which need its model."""
    for index, (stage, fp, call) in enumerate(stages):
        if state.is_done(run, stage, fp):
            log.info("%s: %s already done, skipping", run, stage)
            continue
        log.info("%s: %s starting", run, stage)
        start = time.time()
        try:
            result = call()
        except Preempted:
            raise
        except Exception as error:  # noqa: BLE001 - recorded; the other stages and runs still go ahead
            _record_failure(state, workdir, run, stage, fp, error)
            if index == 0:
                return
            continue
        state.set(run, stage, {"status": "done", "fingerprint": fp,
                               "wall_s": round(time.time() - start, 1), "result": result})
        if _is_main_process():
            (workdir / "errors" / f"{_error_name(run)}.{stage}.txt").unlink(missing_ok=True)  # an earlier failure


def _error_name(run: str) -> str:
    return run.replace("/", ".")


def _record_failure(state: AblationState, workdir: Path, run: str, stage: str, fp: str,
                    error: Exception) -> None:
    log.error("%s: %s failed: %s: %s", run, stage, type(error).__name__, error)
    if _is_main_process():
        errors = workdir / "errors"
        errors.mkdir(exist_ok=True)
        (errors / f"{_error_name(run)}.{stage}.txt").write_text(
            "".join(traceback.format_exception(type(error), error, error.__traceback__)))
    first_line = str(error).splitlines()[0] if str(error) else ""
    state.set(run, stage, {"status": "failed", "fingerprint": fp, "error": f"{type(error).__name__}: {first_line}"})


# --------------------------------------------------------------------------- report


def _machine() -> str:
    """One line saying what ran it; the load average matters on a shared machine."""
    from roformer.bench.common import machine_info

    m = machine_info()
    desc = f"{m['device_count']} x {m['device_kind']} ({m['platform']}), {m['cpu_count']} CPU cores"
    if hasattr(os, "getloadavg"):
        desc += ", load average {:.1f}".format(os.getloadavg()[1])  # 5-minute
    return desc


def _run_status(records: dict[str, dict], stages: list[str]) -> dict:
    failed = [s for s in stages if records[s].get("status") == "failed"]
    if failed:
        return {"status": "failed", "failed_stage": failed[0], "error": records[failed[0]].get("error")}
    if all(records[s].get("status") == "done" for s in stages):
        return {"status": "done"}
    return {"status": "pending"}


def build_report(config: ml_collections.ConfigDict, workdir: Path, state: AblationState) -> dict:
    """The report dict (ablation.json) from the state file and the run directories."""
    pre = config.pretrain
    steps = pretrain_steps(config)
    tokens_per_step = pre.train.batch_size * pre.train.seq_len
    glue_tasks = split_list(config.glue.task)
    setup = {
        "size": pre.model.size,
        "data": pre.data.files if pre.data.source == "files" else pre.data.source,
        "vocab": pre.data.vocab or f"WordPiece {pre.data.vocab_size} trained on the corpus",
        "seq_len": pre.train.seq_len,
        "batch_size": pre.train.batch_size,
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "seeds": _seeds_text(config),
        "glue": (f"{config.glue.task} (median of {config.glue.seeds} fine-tuning seed"
                 f"{'s' if config.glue.seeds > 1 else ''} per pretrained model)" if glue_tasks else "skipped"),
        "machine": _machine(),
    }
    unigram = _unigram_loss(workdir, config)
    if unigram is not None:
        setup["unigram_loss"] = unigram
    stages = [s for s in RUN_STAGES if s != "glue" or glue_tasks]
    runs = []
    for scheme, seed in planned_runs(config):
        name = f"{scheme}/seed{seed}"
        records = {s: state.get(name, s) for s in stages}
        row: dict[str, Any] = {"scheme": scheme, "seed": seed, **_run_status(records, stages),
                               "pretrain_workdir": f"pretrain/{name}", "glue_workdir": None,
                               "learning_rate": scheme_pretrain_config(config, scheme, seed).train.learning_rate}
        row["wall_s"] = round(sum(r.get("wall_s", 0.0) for r in records.values()), 1)
        metrics = read_metrics(workdir / row["pretrain_workdir"] / "metrics.jsonl")
        row.update(report.pretrain_summary(metrics))
        row["curve"] = report.eval_curve(metrics, tokens_per_step)
        ext = records["extrapolation"].get("result") or {}
        row["params"] = ext.get("params")
        row["extrapolation"] = ext.get("extrapolation")
        if records.get("glue", {}).get("status") == "done":
            row["glue_workdir"] = f"glue/{name}"
            results = workdir / row["glue_workdir"] / "glue_results.json"
            row["glue"] = report.glue_summary(json.loads(results.read_text())) if results.exists() else None
        runs.append(row)
    extension = []
    if config.extension.enabled:
        for seed in range(extension_seeds(config)):
            for method in split_list(config.extension.methods):
                name = f"extension/{method}/seed{seed}"
                records = {s: state.get(name, s) for s in EXTENSION_STAGES}
                row = {"method": method, "seed": seed, **_run_status(records, list(EXTENSION_STAGES)),
                       "workdir": name,
                       "wall_s": round(sum(r.get("wall_s", 0.0) for r in records.values()), 1)}
                row.update(records["extension_eval"].get("result") or {})
                extension.append(row)
        setup["extension"] = (f"{config.extension.scheme} at {config.extension.factor}x the length, "
                              f"{config.extension.steps} steps, lr {config.extension.learning_rate}, "
                              f"pretraining seed{'s' if extension_seeds(config) > 1 else ''} "
                              f"{', '.join(map(str, range(extension_seeds(config))))}")
    result = report.summarize(setup, runs, extension, reference=config.reference, baseline=config.baseline,
                              order_threshold=config.order_threshold)
    result["position_signal"] = _position_signals(workdir, config)
    return result


def _seeds_text(config: ml_collections.ConfigDict) -> int | str:
    """config.seeds, or per scheme when config.scheme_seeds makes them differ."""
    counts = {scheme: scheme_seeds(config, scheme) for scheme in split_list(config.schemes)}
    if len(set(counts.values())) <= 1:
        return config.seeds
    return " / ".join(f"{scheme} {n}" for scheme, n in counts.items())


def _position_signals(workdir: Path, config: ml_collections.ConfigDict) -> dict[str, dict]:
    """Per scheme, the position / token signal ratios at initialisation
    (roformer.model.position_signal), at the pretraining length, cached in the workdir."""
    from roformer.model.position_signal import position_signals
    from roformer.train.loop import build_model_config

    cache = workdir / "position_signal.json"
    configs = {scheme: scheme_pretrain_config(config, scheme) for scheme in split_list(config.schemes)}
    fp = fingerprint({s: c.model.to_dict() for s, c in configs.items()}, config.pretrain.data.vocab_size)
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("fingerprint") == fp:
            return saved["ratios"]
    # The ratios do not depend on which ids the vocabulary holds, only on the parameters.
    models = {s: build_model_config(c.model, vocab_size=config.pretrain.data.vocab_size) for s, c in configs.items()}
    ratios = position_signals(models, seed=0, length=config.pretrain.train.seq_len)
    if _is_main_process():
        cache.write_text(json.dumps({"fingerprint": fp, "ratios": ratios}) + "\n")
    return ratios


def _unigram_loss(workdir: Path, config: ml_collections.ConfigDict) -> float | None:
    """The corpus's context-free MLM loss under the runs' (pinned) vocabulary, cached in the
    workdir."""
    cache = workdir / "unigram_loss.json"
    fp = fingerprint(config.pretrain.data)
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("fingerprint") == fp:
            return saved["unigram_loss"]
    vocab = Path(config.pretrain.data.vocab or workdir / PINNED_TOKENIZER)
    if not vocab.exists():
        return None
    from roformer.data import DataConfig, make_pretrain_data

    data_cfg = dataclasses.replace(DataConfig.from_mapping(config.pretrain.data), vocab=str(vocab))
    data = make_pretrain_data(data_cfg, seq_len=config.pretrain.train.seq_len, batch_size=1, seed=0,
                              show_progress=False)
    value = data.unigram_loss()
    if _is_main_process():
        cache.write_text(json.dumps({"fingerprint": fp, "unigram_loss": value}) + "\n")
    return value


def _write_report(config, workdir: Path, state: AblationState) -> dict:
    result = build_report(config, workdir, state)
    if _is_main_process():
        report.write_report(result, workdir)
    return result


# --------------------------------------------------------------------------- CLI


def main(argv):
    from absl import flags

    from roformer import cli

    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    result = run_ablation(flags.FLAGS.config, flags.FLAGS.workdir)
    if _is_main_process():
        print((Path(flags.FLAGS.workdir) / report.REPORT_MD).read_text())
    if any(s["status"] == "failed" for s in result["runs"] + result["extension"]["runs"]):
        sys.exit(1)


if __name__ == "__main__":
    # Flags are defined only when run as a program: the library function must stay
    # importable next to roformer.pretrain, which defines its own --config.
    from absl import flags
    from ml_collections import config_flags

    from roformer import cli

    config_flags.DEFINE_config_file("config", None, "ablation config file (configs/ablation.py[:smoke|reference])")
    flags.DEFINE_string("workdir", None, "directory for all runs and the report")
    flags.mark_flags_as_required(["config", "workdir"])
    cli.run(main, doc=__doc__, help_config=CONFIG_DIR / "ablation.py")
