"""`run_glue(config, workdir)`: every task x seed, medians, GLUE scores, submission.

Writes into the workdir: `config.json` (resolved), `metrics.jsonl` (training and eval
rows, tagged with task and seed), TensorBoard events (`tensorboard/<task>_seed<k>`) and a
W&B run per task and seed where ROFORMER_WANDB_PROJECT names a project,
`glue_results.json` / `glue_results.md` (rewritten after each task, so a partial run
still leaves results), and with `predict_test` the leaderboard TSVs in `submission/`
plus `submission.zip`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import time
from pathlib import Path

import ml_collections
import numpy as np

from roformer.accelerator import enable_compilation_cache, startup_line
from roformer.convert import save_converted, save_hf, save_hf_tokenizer
from roformer.data.tokenizer import load_tokenizer
from roformer.errors import ConfigError, UserError
from roformer.files import write_json_atomic, write_text_atomic, writing
from roformer.glue import features as features_lib
from roformer.glue import resume
from roformer.glue.finetune import (STEPS_PER_CALL, Classifier, Programs, Protocol, create_model, finetune, predict,
                                    predict_lengths, predict_shapes, task_padding, train_programs)
from roformer.glue.init import encoder_state, load_init, resolve_model_config
from roformer.glue.metrics import glue_scores, scores_line, task_metrics
from roformer.glue.program_store import ProgramStore
from roformer.glue.readers import GlueDataError, check_data_dir, glue_source, local_path, read_split
from roformer.glue.settings import check_config
from roformer.glue.submission import finish_submission, write_predictions
from roformer.glue.tasks import TASKS, TaskSpec, parse_task_list
from roformer.model.attention import check_attention_impl
from roformer import workdir_kind
from roformer.model.positions import POSITION_SCHEMES
from roformer.train.metrics import JsonlBackend, MetricsWriter, TensorBoardBackend, WandbBackend, wandb_project
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.glue")

MODELS = "models"   # the fine-tuned models a run keeps: <workdir>/models/<task>/seed<k>


class RunLog:
    """metrics.jsonl rows tagged with task/seed, written through the writer pretraining logs
    with (roformer.train.metrics.MetricsWriter), one per task and seed in turn: its TensorBoard
    run `tensorboard/<task>_seed<k>` (so they can be compared side by side; `train/` and `eval/`
    tags, the run's config as text) and, where ROFORMER_WANDB_PROJECT names a project, its W&B
    run (grouped by workdir). The files (and `config.json`, given as `run_config`) are written
    with the first row, so a run refused while it reads and featurizes its data leaves none. A
    task's rows are all written by every run, so its first row also replaces what an earlier
    (killed) attempt logged for it: its rows and its TensorBoard runs (a seed resumed from its
    saved state, roformer.glue.resume, logs again the rows saved with it)."""

    def __init__(self, workdir: Path, run_config: dict):
        self._workdir = workdir
        self._run_config = run_config
        self._started = False
        self._writer: tuple[str, MetricsWriter] | None = None   # the (task, seed) run logging now
        self._tasks = set()   # the tasks this run has logged

    def write(self, task: str, seed: int, step: int, scalars: dict, *, section: str = "train") -> None:
        """A row of (task, seed) at `step`; `section`: "train" (losses) or "eval" (dev scores)."""
        what = f"the GLUE metrics in {self._workdir}"
        run = f"{task}_seed{seed}"
        with writing(what):
            if not self._started:
                workdir_kind.record(self._workdir, workdir_kind.GLUE)
                write_json_atomic(self._workdir / "config.json", self._run_config, indent=2, default=str)
                self._started = True
            if task not in self._tasks:
                self._replace_earlier(task)
            if self._writer is None or self._writer[0] != run:
                self._close_writer()   # one at a time: a W&B process has one run open
                self._writer = run, MetricsWriter(self._workdir, enabled=True, what=what,
                                                  backends=functools.partial(self._backends, task, seed))
        self._writer[1].write(step, scalars, section=section)

    def _backends(self, task: str, seed: int, workdir: Path, *, resume_step: int | None = None) -> list:
        run = f"{task}_seed{seed}"
        backends = [JsonlBackend(workdir, labels={"task": task, "seed": seed}),
                    TensorBoardBackend(workdir / "tensorboard" / run, config=self._run_config)]
        if wandb_project():   # a fresh W&B run per task and seed: a rerun logs all its rows again
            backends.append(WandbBackend(workdir, wandb_project(), name=f"{workdir.name}/{run}", group=workdir.name,
                                         config=self._run_config, keep_id=False))
        return backends

    def _replace_earlier(self, task: str) -> None:
        """Drop an earlier attempt's rows of `task` (and a torn last line) and its TensorBoard runs."""
        self._tasks.add(task)
        self._close_writer()
        path = self._workdir / "metrics.jsonl"
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for line in lines if _logged_task(line) not in (task, None)]
            if kept != lines:
                write_text_atomic(path, "".join(kept), encoding="utf-8")
        for earlier in (self._workdir / "tensorboard").glob(f"{task}_seed*"):
            shutil.rmtree(earlier, ignore_errors=True)

    def _close_writer(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer[1], None
            writer.close()

    def close(self) -> None:
        self._close_writer()


def _logged_task(line: str) -> str | None:
    """The task of a metrics.jsonl line; None for a torn one (a run killed mid-write)."""
    try:
        return json.loads(line)["task"]
    except (ValueError, KeyError, TypeError):
        return None


def data_kwargs(config) -> dict:
    """read_split's keyword arguments: where a GLUE config reads its data."""
    source, data_dir = glue_source(config.source, config.data_dir)
    return dict(source=source, data_dir=data_dir, hf_path=config.hf_path,
                hf_cache_dir=config.hf_cache_dir or None,
                tfds_data_dir=config.tfds_data_dir or None)


def limit_examples(examples: list, n: int) -> list:
    """The first `n` examples (all of them when n <= 0): max_train_examples, max_eval_examples."""
    return examples[:n] if n and n > 0 else examples


def trained_tasks(tasks: list[str]) -> list[str]:
    """The tasks whose models a run trains or evaluates: AX has no model of its own (no
    training data), MNLI's predicts it."""
    if "ax" not in tasks:
        return tasks
    return [t for t in tasks if t != "ax"] + ([] if "mnli" in tasks else ["mnli"])


def eval_examples(task: TaskSpec, config, *, with_tests: bool) -> tuple[dict, dict, dict]:
    """(the dev splits' examples, limited to config.max_eval_examples; with `with_tests`,
    the test splits `task`'s model predicts, keyed (task name, split), else {}; the full size
    of each dev split that limit cut, {} when none)."""
    read = data_kwargs(config)
    full = {s: read_split(task, s, **read) for s in task.eval_splits}
    evals = {s: limit_examples(examples, config.max_eval_examples) for s, examples in full.items()}
    cut = {s: len(full[s]) for s in evals if len(evals[s]) < len(full[s])}
    tests = {(t.name, s): read_split(t, s, **read) for t, s in predicted_splits(task)} if with_tests else {}
    return evals, tests, cut


def scores(task_results: dict[str, dict]) -> dict:
    """glue_results.json's `glue`: the GLUE scores of the tasks' medians; a task scored on part
    of a dev split (`eval_cut_from`) leaves every score it enters not complete."""
    return glue_scores({t: r["median"] for t, r in task_results.items()},
                       cut=[t for t, r in task_results.items() if r.get("eval_cut_from")])


def predict_kwargs(config, protocol: Protocol, pad_id: int) -> dict:
    """`predict`'s keyword arguments under `config` (eval_batch_size, eval_padding)."""
    return dict(batch_size=config.eval_batch_size, pad_id=pad_id,
                lengths=predict_lengths(config.get("eval_padding", "auto"), protocol.max_seq_len))


def predicted_shapes(features: list, predict_kw: dict) -> list[tuple[int, int]]:
    """The predict programs `predict` runs on `features` with `predict_kw` (`predict_kwargs`)."""
    return predict_shapes(features, batch_size=predict_kw["batch_size"], lengths=predict_kw["lengths"])


def score_eval_splits(task: TaskSpec, classifier: Classifier, programs: Programs, eval_f: dict, *,
                      predict_kw: dict, run_log: RunLog, seed: int, step: int) -> dict:
    """{split: the task's metrics of `classifier` on its featurized dev split}, each also
    logged as a row of (task, seed) at `step`."""
    scores = {}
    for split, f in eval_f.items():
        scores[split] = task_metrics(task, f.labels, predict(classifier, programs, f, **predict_kw))
        run_log.write(task.name, seed, step, {f"{split}_{k}": v for k, v in scores[split].items()}, section="eval")
    return scores


def seed_medians(task: TaskSpec, seeds: dict) -> dict:
    """{split: {metric: the median over the seeds' results}}."""
    return {split: {m: float(np.median([seeds[s][split][m] for s in seeds])) for m in task.metrics}
            for split in task.eval_splits}


class ProgramsCache:
    """One set of compiled programs per (architecture, optimizer setting, head kind), shared
    by the seeds and the tasks of a run (most GLUE tasks have the same two-label head), and
    kept in `store` for later runs where there is one."""

    def __init__(self, store: ProgramStore | None = None):
        self._programs, self._store = {}, store

    def get(self, classifier: Classifier, protocol: Protocol, regression: bool) -> Programs:
        key = (classifier.graphdef, protocol.update_settings, regression)
        if key not in self._programs:
            self._programs[key] = Programs(classifier, protocol.update_settings, regression, self._store)
        return self._programs[key]


def task_features(task: TaskSpec, config, tokenizer, *, with_tests: bool):
    """The task's protocol, its featurized splits (train, eval by split, test by (task, split),
    and which eval splits config.max_eval_examples cut) and the training batches' padding."""
    protocol = Protocol.from_config(config, task.name)
    train = limit_examples(read_split(task, task.train_split, **data_kwargs(config)), protocol.max_train_examples)
    evals, tests, cut = eval_examples(task, config, with_tests=with_tests)
    if cut:
        log.warning("%s: scored on the first %d examples of %s (config.max_eval_examples): not the task's score",
                    task.display, config.max_eval_examples, ", ".join(f"{s} ({n:,})" for s, n in cut.items()))

    def feats(examples):
        return features_lib.featurize(examples, tokenizer, protocol.max_seq_len,
                                      regression=task.is_regression)

    train_f = feats(train)
    padding, why = task_padding(config.get("train_padding", "auto"), train_f, protocol)
    log.info("%s: training batches %s (%s)", task.display, "packed" if padding == "packed" else f"padded per {padding}",
             why)
    eval_f = {s: feats(ex) for s, ex in evals.items()}
    test_f = {key: feats(ex) for key, ex in tests.items()}
    return protocol, (train_f, eval_f, test_f, cut), padding


def run_task(task: TaskSpec, config, *, tokenizer, special, model_config, init_state,
             run_log: RunLog, submission_dir: Path | None, programs_cache: ProgramsCache,
             models_dir: Path, resume_dir: Path | None = None, resume_identity: dict | None = None) -> dict:
    """Fine-tune and score `task` with every seed. With `resume_dir` (and config.checkpoint_every
    > 0) each seed's state is saved in resume_dir/seed<k> and a rerun goes on from it
    (roformer.glue.resume); `resume_identity` says what else the states depend on (init, model)."""
    protocol, (train_f, eval_f, test_f, cut), padding = task_features(task, config, tokenizer,
                                                                       with_tests=submission_dir is not None)
    predict_kw = predict_kwargs(config, protocol, special.pad_id)

    seeds, test_predictions, trained = {}, {}, {}
    task_start, programs = time.time(), None
    every = config.get("checkpoint_every", 0)
    identity = {**(resume_identity or {}), "task": task.name, "protocol": dataclasses.asdict(protocol),
                "train_padding": padding, "steps_per_call": STEPS_PER_CALL,
                "train_data": resume.data_digest(train_f.input_ids, train_f.labels)}
    for seed in range(config.seeds):
        start = time.time()
        classifier = Classifier.split(create_model(model_config, task.num_labels, seed, init_state))
        if programs is None:
            programs = programs_cache.get(classifier, protocol, task.is_regression)
            compiled_before = programs.compile_seconds   # shared with earlier tasks
            # Every program this task runs, compiled before training (tracing them checks that
            # the attention kernel takes them), then one real prediction on a tiny batch: a
            # model that cannot predict fails in seconds, not after training.
            programs.prepare(
                train_programs(train_f, protocol, range(config.seeds), padding),
                predicted_shapes([*eval_f.values(), *test_f.values()], predict_kw))
            predict(classifier, programs, train_f.head(2), **predict_kw)
        checkpoints = (resume.SeedCheckpoints(resume_dir / f"seed{seed}", {**identity, "seed": seed}, every)
                       if resume_dir is not None and every > 0 else None)
        try:
            classifier, info = finetune(classifier, programs, train_f, protocol, seed=seed, pad_id=special.pad_id,
                                        desc=f"{task.display} seed {seed}", log_every=config.log_every,
                                        log_fn=lambda row, s=seed: run_log.write(task.name, s, row["step"], row),
                                        progress=config.progress_bar, padding=padding, checkpoints=checkpoints)
        finally:
            if checkpoints is not None:
                checkpoints.close()   # a save in flight completes (a Ctrl-C keeps it)
        result = {"steps": info["steps"], "final_train_loss": info["final_loss"],
                  "train_steps_per_sec": info["steps_per_sec"],
                  "train_seconds": round(time.time() - start, 2)}
        result.update(score_eval_splits(task, classifier, programs, eval_f, predict_kw=predict_kw,
                                        run_log=run_log, seed=seed, step=info["steps"]))
        seeds[seed] = result
        log.info("%s seed %d: %s (%.1f steps/s)", task.display, seed,
                 scores_line({s: result[s] for s in task.eval_splits}), info["steps_per_sec"])
        if test_f:
            test_predictions[seed] = {key: predict(classifier, programs, f, **predict_kw)
                                      for key, f in test_f.items()}
        if config.save_models != "none":
            trained[seed] = classifier

    medians = seed_medians(task, seeds)
    out = {"protocol": dataclasses.asdict(protocol), "train_padding": padding,
           "wall_seconds": round(time.time() - task_start, 2), "compile_seconds": round(programs.compile_seconds - compiled_before, 2),
           "num_train_examples": len(train_f),
           "num_eval_examples": {s: len(f) for s, f in eval_f.items()},
           **({"eval_cut_from": cut} if cut else {}),
           "seeds": {str(s): r for s, r in seeds.items()}, "median": medians}
    chosen = median_seed(task, seeds, medians)
    if test_predictions:
        for (t, split), f in test_f.items():
            write_predictions(submission_dir, TASKS[t], split, f.idx,
                              test_predictions[chosen][(t, split)])
        out["submitted_seed"] = chosen
    if config.save_models != "none":
        out["saved_models"] = save_models(trained, chosen, models_dir / task.name, tokenizer,
                                          every_seed=config.save_models == "all", label_names=task.label_names)
    return out


def save_models(trained: dict[int, Classifier], chosen: int, task_dir: Path, tokenizer, *,
                every_seed: bool, label_names: tuple[str, ...] | None = None) -> dict:
    """The fine-tuned classifiers of a task in roformer.convert's format with their tokenizer,
    task_dir/seed<k> (`python -m roformer.convert to-hf` exports one, load_converted reloads
    it): the median seed's, or `every_seed`'s, replacing what task_dir held. The median seed's is also exported to
    task_dir/hf as HF RoFormerForSequenceClassification (what AutoTokenizer and
    AutoModelForSequenceClassification load, with the task's class names as id2label), when
    HF's RoFormer can express it."""
    saved = {"median_seed": chosen, "dir": str(task_dir)}
    # An earlier run's models of this task (in the same workdir) go: none of another run's
    # seeds may stay beside this run's for --eval_only to score as one run's.
    shutil.rmtree(task_dir, ignore_errors=True)
    for seed, classifier in trained.items():
        if every_seed or seed == chosen:
            model = classifier.model()
            # model_config.json last (save_converted): a save killed mid-way leaves a directory
            # --eval_only does not take for a model
            tokenizer.save(task_dir / f"seed{seed}")
            save_converted(model, task_dir / f"seed{seed}")
            if seed == chosen:
                try:
                    save_hf(model, None, task_dir / "hf", label_names=label_names)
                except ConfigError as why:   # a position scheme HF's RoFormer cannot express
                    saved.update(hf=None, hf_not_exported=str(why))
                else:
                    save_hf_tokenizer(tokenizer, task_dir / "hf",
                                      model_max_length=model.config.max_position_embeddings)
                    saved["hf"] = str(task_dir / "hf")
    return saved


def predicted_splits(task: TaskSpec) -> list[tuple[TaskSpec, str]]:
    """The test splits `task`'s model predicts: its own, plus AX for MNLI."""
    return [(t, s) for t in TASKS.values() if t is task or t.predicted_by == task.name
            for s in t.test_splits]


def check_local_files(tasks: list[str], config) -> None:
    """Before anything trains: every split the run reads from a local GLUE dir is there,
    or one GlueDataError names all that are missing (HF / TFDS are read as they come)."""
    source, data_dir = glue_source(config.source, config.data_dir)
    if source != "local":
        return
    check_data_dir(data_dir)
    if not Path(data_dir).is_dir():
        raise GlueDataError(f"config.data_dir={data_dir!r}: no such directory (expected a GLUE dir in "
                            "the download_glue_data.py layout)")
    missing, complete = [], []
    for name in tasks:
        task = TASKS[name]
        splits = [(task, s) for s in (task.train_split, *task.eval_splits) if s]
        splits += predicted_splits(task) if config.predict_test else []
        absent = [f"{t.local_dir}/{t.local[s].file}" for t, s in splits
                  if not local_path(t, s, data_dir).is_file()]
        missing += absent
        complete += [] if absent else [name]
    if missing:
        runnable = (f", or run only the tasks whose files are all there: --config.task={','.join(complete)}"
                    if complete else "")
        raise GlueDataError(f"GLUE files missing in {data_dir}: {', '.join(missing)}. Point "
                            f"config.data_dir at a complete GLUE copy{runnable}")


def median_seed(task: TaskSpec, seeds: dict, medians: dict) -> int:
    """The seed whose headline dev metric is closest to the median (lowest seed on ties):
    its model's test predictions are the ones submitted."""
    split, metric = task.eval_splits[0], task.metrics[0]
    target = medians[split][metric]
    return min(seeds, key=lambda s: (abs(seeds[s][split][metric] - target), s))


def results_markdown(results: dict) -> str:
    lines = ["| Task | Split | Metric | Median | Per seed |", "|---|---|---|---|---|"]
    for name, r in results["tasks"].items():
        task = TASKS[name]
        for split, metrics in r["median"].items():
            for metric, value in metrics.items():
                per_seed = " ".join(f"{100 * s[split][metric]:.1f}" for s in r["seeds"].values())
                lines.append(f"| {task.display} | {split} | {metric} | {100 * value:.2f} | "
                             f"{per_seed} |")
    lines.append("")
    for key, score in results["glue"].items():
        value = "n/a" if score["score"] is None else f"{score['score']:.2f}"
        gaps = ([f"missing {', '.join(score['missing'])}"] if score["missing"] else []) + (
            [f"dev splits cut by max_eval_examples: {', '.join(score['cut'])}"] if score.get("cut") else [])
        note = "" if score["complete"] else f" (partial: {'; '.join(gaps)})"
        lines.append(f"- **{key}** = {value}{note}: {score['description']}")
    return "\n".join(lines) + "\n"


def write_results(workdir: Path, results: dict) -> None:
    """glue_results.json and glue_results.md, each replaced atomically."""
    write_json_atomic(workdir / "glue_results.json", results, indent=2, default=_json)
    write_text_atomic(workdir / "glue_results.md", results_markdown(results))


def _json(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value)}")


def run_glue(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Fine-tune and evaluate every requested task; returns the results dict that is
    also written to `glue_results.json`. A workdir another live run is using is refused
    (roformer.workdir_lock)."""
    with workdir_lock(workdir), writing(f"the GLUE outputs in {workdir}"):
        workdir_kind.claim(workdir, workdir_kind.GLUE)   # before anything is written
        return _run_glue(config, Path(workdir))


def _run_glue(config: ml_collections.ConfigDict, workdir: Path) -> dict:
    check_config(config)
    workdir.mkdir(parents=True, exist_ok=True)
    tasks = trained_tasks(parse_task_list(config.task))
    check_local_files(tasks, config)
    for name in tasks:   # before anything is read or written
        Protocol.from_config(config, name).check(name)

    init = load_init(config.init, step=config.init_step)
    if config.vocab:
        tokenizer, vocab = load_tokenizer(config.vocab, lowercase=config.lowercase), config.vocab
    else:
        tokenizer, vocab = init.tokenizer(), init.vocab or "trained with the checkpoint"
    if tokenizer is None:
        raise ConfigError("no tokenizer: set config.vocab to a vocab.txt / tokenizer.json "
                          + (f"(the init checkpoint {init.path} names none)" if init.path
                            else "(required with config.init=none)"))
    special = features_lib.tokenizer_special_ids(tokenizer)
    model_config = resolve_model_config(config.model, init, tokenizer.vocab_size)
    check_attention_impl(model_config)   # the checkpoint's attention_impl may not suit this device
    longest = POSITION_SCHEMES[model_config.position].max_length(model_config)
    for name in tasks:
        if longest is not None and Protocol.from_config(config, name).max_seq_len > longest:
            raise ConfigError(f"max_seq_len={Protocol.from_config(config, name).max_seq_len} of {name} is longer than "
                              f"the {longest} positions the model's {model_config.position} position table holds: "
                              f"lower --config.max_seq_len to at most {longest}")
    log.info("%s", startup_line(model_config))
    source, data_dir = glue_source(config.source, config.data_dir)   # said once the checks passed
    log.info("GLUE data: %s", f"the files in {data_dir}" if source == "local" else
             f"HF datasets' {config.hf_path}" if source == "hf" else "TFDS")
    cache = enable_compilation_cache(config.get("compilation_cache_dir", ""))
    if cache:
        log.info("compiled programs are cached in %s, and kept whole in %s", cache, ProgramStore.under(cache).directory)
    init_state = (None if init.encoder_params is None
                  else encoder_state(model_config, init.encoder_params))

    header = {"init": {"kind": init.kind, "path": init.path, "step": init.step},
              "vocab": str(vocab), "model": model_config.to_dict()}
    submission_dir = workdir / "submission" if config.predict_test else None
    started = time.time()   # submission files older than this are an earlier run's
    results = {**header, "seeds": config.seeds, "tasks": {}, "glue": glue_scores({})}
    run_log = RunLog(workdir, {"config": config.to_dict(), **header})
    programs_cache, failed = ProgramsCache(ProgramStore.under(cache)), {}
    try:
        for name in tasks:
            try:
                results["tasks"][name] = run_task(
                    TASKS[name], config, tokenizer=tokenizer, special=special,
                    model_config=model_config, init_state=init_state, run_log=run_log,
                    submission_dir=submission_dir, programs_cache=programs_cache,
                    models_dir=workdir / MODELS, resume_dir=resume.task_dir(workdir, name),
                    resume_identity={"init": header["init"], "model": header["model"], "vocab": header["vocab"]})
            except KeyboardInterrupt:
                if resume.task_dir(workdir, name).is_dir():
                    log.warning("%s interrupted: the same command again goes on from its state saved in %s",
                                TASKS[name].display, resume.task_dir(workdir, name))
                raise
            except UserError:
                raise
            except Exception as error:   # one task failing keeps the others' results
                log.exception("%s failed; the other tasks go on", TASKS[name].display)
                failed[name] = f"{type(error).__name__}: {error}".split("\n")[0]
                results["failed"] = failed
            results["glue"] = scores(results["tasks"])
            write_results(workdir, results)
            if name in results["tasks"]:
                resume.remove_task(workdir, name)   # its results are written: its states are not needed
    finally:
        run_log.close()
    if submission_dir is not None:
        results["submission"] = finish_submission(submission_dir, workdir / "submission.zip", started)
        write_results(workdir, results)
    if failed:
        raise RuntimeError(f"GLUE task(s) failed: {'; '.join(f'{t}: {why}' for t, why in failed.items())}. "
                           f"The other tasks' results are in {workdir / 'glue_results.json'}")
    return results
