"""`evaluate_glue(config, saved, workdir)`: GLUE scores of the fine-tuned models a run kept,
without training (`python -m roformer.glue --eval_only=<GLUE workdir> --workdir=DIR`).

`saved` is the workdir of an earlier `run_glue` with save_models median or all: its
`models/<task>/seed<k>` (roformer.convert's format, tokenizer included) are reloaded, and
each predicts the dev splits, scored by the metrics the training run used; with
`predict_test` the median of the saved seeds predicts the test splits for a leaderboard
submission. The outputs are a training run's, in `workdir`: glue_results.json / .md,
metrics.jsonl, TensorBoard, submission/ and submission.zip.

The config says what to evaluate and on which data (task, source, data_dir,
max_eval_examples, eval_batch_size, predict_test, model.dtype / attention_impl). What the
models were fine-tuned with stays theirs: the tokenizer and the architecture come with the
models, and a config whose max_seq_len or model size / vocab_size / position differs
from the saved run's is refused (the scores would not be those models' on the inputs they
were trained for). `task=all` means every task the workdir saved models of.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import re
from pathlib import Path

import ml_collections

from roformer.accelerator import enable_compilation_cache, startup_line
from roformer.convert import OUR_CONFIG_FILE, load_converted, read_converted_config
from roformer.data.tokenizer import load_tokenizer
from roformer.errors import ConfigError
from roformer.files import writing
from roformer.glue import features as features_lib
from roformer.glue.finetune import Classifier, Protocol, predict
from roformer.glue.init import FINETUNE_FIELDS, InitSource, resolve_model_config
from roformer.glue.metrics import glue_scores, scores_line
from roformer.glue.program_store import ProgramStore
from roformer.glue.run import (MODELS, ProgramsCache, RunLog, eval_examples, median_seed, predict_kwargs,
                               predicted_shapes, score_eval_splits, scores, seed_medians, trained_tasks,
                               write_results)
from roformer.glue.settings import check_config
from roformer.glue.submission import finish_submission, write_predictions
from roformer.glue.tasks import TASKS, parse_task_list
from roformer.model import ModelConfig
from roformer.model.attention import check_attention_impl
from roformer import workdir_kind
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.glue")


@dataclasses.dataclass
class SavedRun:
    """The fine-tuned models an earlier GLUE run kept, and the config it ran with."""
    path: Path
    config: ml_collections.ConfigDict   # the run's config.json "config"
    results: dict                       # its glue_results.json ({} when it has none yet)
    seeds: dict[str, dict[int, Path]]   # task -> seed -> model directory

    @classmethod
    def open(cls, path: str | Path) -> "SavedRun":
        path = Path(path).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(f"--eval_only={path}: no such directory (expected the workdir of a GLUE run)")
        seeds: dict[str, dict[int, Path]] = {}
        for model_dir in sorted((path / MODELS).glob("*/seed*")):
            match = re.fullmatch(r"seed(\d+)", model_dir.name)
            if match and (model_dir / OUR_CONFIG_FILE).is_file() and model_dir.parent.name in TASKS:
                seeds.setdefault(model_dir.parent.name, {})[int(match.group(1))] = model_dir
        if not seeds:
            raise ConfigError(f"{path} holds no saved fine-tuned models ({MODELS}/<task>/seed<k>): a GLUE run keeps "
                              "them with save_models=median (the default) or all, not none")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{path} has saved models but no config.json: not a GLUE workdir written by run_glue")
        config = ml_collections.ConfigDict(json.loads(config_file.read_text())["config"])
        results_file = path / "glue_results.json"
        results = json.loads(results_file.read_text()) if results_file.is_file() else {}
        if results.get("tasks") is not None:
            # Models of tasks the last run (whose config.json this is) did not train are an
            # earlier run's, perhaps with other settings: not scored as this run's.
            stale = sorted(set(seeds) - set(results["tasks"]))
            if stale:
                log.warning("%s: models of %s are from an earlier run than its config.json and glue_results.json; "
                            "not evaluated", path, ", ".join(stale))
            seeds = {task: runs for task, runs in seeds.items() if task in results["tasks"]}
            if not seeds:
                raise ConfigError(f"{path}: its saved models are all of tasks its last run did not train "
                                  f"({', '.join(stale)}): no model to evaluate with that run's config")
        return cls(path, config, results, seeds)

    def tasks(self, spec: str) -> list[str]:
        """The tasks `spec` (config.task) names, each with saved models; 'all': every saved task."""
        if spec.strip().lower() == "all":
            return sorted(self.seeds, key=list(TASKS).index)
        tasks = trained_tasks(parse_task_list(spec))
        missing = [t for t in tasks if t not in self.seeds]
        if missing:
            raise ConfigError(f"{self.path} has no saved model of {', '.join(missing)} (it has models of "
                              f"{', '.join(sorted(self.seeds))}): evaluate --config.task={','.join(sorted(self.seeds))}")
        return tasks

    def trained_steps(self, task: str, seed: int) -> int:
        """The optimizer steps the model of (task, seed) was fine-tuned for (0 if unrecorded)."""
        return int(self.results.get("tasks", {}).get(task, {}).get("seeds", {}).get(str(seed), {}).get("steps", 0))

    def check_protocol(self, config, task: str) -> Protocol:
        """The protocol `config` gives `task`, refused where its max_seq_len differs from the
        one the saved model was fine-tuned with."""
        protocol, trained = Protocol.from_config(config, task), Protocol.from_config(self.config, task)
        if protocol.max_seq_len != trained.max_seq_len:
            raise ConfigError(f"config.max_seq_len gives {task} {protocol.max_seq_len} tokens, but its model in "
                              f"{self.path} was fine-tuned with {trained.max_seq_len}: evaluate with the config "
                              f"it was trained with (--config.max_seq_len={trained.max_seq_len})")
        return protocol

    def model_config(self, config, task: str, seed: int) -> tuple[ModelConfig, object]:
        """(the architecture to evaluate (task, seed)'s model with, its tokenizer): the saved
        one with config.model's non-shape settings (dtype, attention_impl), refused where
        config.model names another size, vocab_size or position, or the head is not the task's."""
        model_dir = self.seeds[task][seed]
        meta = read_converted_config(model_dir)   # a damaged file refused in one line naming it
        tokenizer = load_tokenizer(str(model_dir / "tokenizer.json"))
        saved = meta["config"]
        model_config = resolve_model_config(config.model, InitSource("converted", str(model_dir), saved, None, None),
                                            tokenizer.vocab_size)
        spec = TASKS[task]
        if meta.get("num_labels") != spec.num_labels:
            raise ConfigError(f"{model_dir} holds a head of {meta.get('num_labels')} labels, {spec.display} has "
                              f"{spec.num_labels}: not a {spec.display} model")
        return model_config, tokenizer

    def load(self, config, task: str, seed: int) -> tuple[ModelConfig, Classifier, object]:
        """(ModelConfig, Classifier, tokenizer) of (task, seed)'s saved model (`model_config`'s checks)."""
        model_config, tokenizer = self.model_config(config, task, seed)
        _, model = load_converted(self.seeds[task][seed], **{k: getattr(model_config, k) for k in FINETUNE_FIELDS})
        return model_config, Classifier.split(model), tokenizer


def evaluate_glue(config: ml_collections.ConfigDict, saved: str | Path, workdir: str | Path) -> dict:
    """Score the models `saved` (a GLUE workdir) kept on the dev splits (and with
    `predict_test`, write a submission) into `workdir`; returns the results dict also
    written to `glue_results.json`. Refused before anything is written: a workdir with no
    saved models, a task without any, a config that disagrees with the saved run."""
    check_config(config)
    run = SavedRun.open(saved)
    workdir = Path(workdir)
    if workdir.expanduser().resolve() == run.path:
        raise ConfigError(f"--workdir is the evaluated run's own workdir {run.path}: give a new one "
                          "(its results would be replaced)")
    tasks = run.tasks(config.task)
    protocols = {name: run.check_protocol(config, name) for name in tasks}
    for name in tasks:
        for seed in run.seeds[name]:
            run.model_config(config, name, seed)
    with workdir_lock(workdir), writing(f"the GLUE outputs in {workdir}"):
        workdir_kind.claim(workdir, workdir_kind.GLUE)   # before anything is written
        workdir.mkdir(parents=True, exist_ok=True)
        return _evaluate(config, run, tasks, protocols, workdir)


def _evaluate(config, run: SavedRun, tasks: list[str], protocols: dict, workdir: Path) -> dict:
    submission_dir = workdir / "submission" if config.predict_test else None
    started_at = time.time()   # submission files older than this are an earlier run's
    header = {"eval_only": str(run.path), "init": run.results.get("init"), "vocab": run.results.get("vocab")}
    results = {**header, "tasks": {}, "glue": glue_scores({})}
    run_log = RunLog(workdir, {"config": config.to_dict(), **header})
    cache = enable_compilation_cache(config.get("compilation_cache_dir", ""))
    programs_cache, started = ProgramsCache(ProgramStore.under(cache)), False
    try:
        for name in tasks:
            task, protocol = TASKS[name], protocols[name]
            evals, tests, cut = eval_examples(task, config, with_tests=submission_dir is not None)
            seeds, test_predictions, featurized = {}, {}, {}
            for seed, model_dir in sorted(run.seeds[name].items()):
                model_config, classifier, tokenizer = run.load(config, name, seed)
                if not started:
                    check_attention_impl(model_config)
                    log.info("%s", startup_line(model_config))
                    if cache:
                        log.info("compiled programs are cached in %s", cache)
                    started = True
                if tokenizer.hash not in featurized:   # the seeds of a task share their tokenizer
                    feats = lambda ex, tokenizer=tokenizer, protocol=protocol, task=task: (  # noqa: E731
                        features_lib.featurize(ex, tokenizer, protocol.max_seq_len, regression=task.is_regression))
                    featurized[tokenizer.hash] = ({s: feats(ex) for s, ex in evals.items()},
                                                  {key: feats(ex) for key, ex in tests.items()})
                eval_f, test_f = featurized[tokenizer.hash]
                programs = programs_cache.get(classifier, protocol, task.is_regression)
                predict_kw = predict_kwargs(config, protocol, features_lib.tokenizer_special_ids(tokenizer).pad_id)
                programs.prepare([], predicted_shapes([*eval_f.values(), *test_f.values()], predict_kw))
                result = {"model": str(model_dir),
                          **score_eval_splits(task, classifier, programs, eval_f, predict_kw=predict_kw,
                                              run_log=run_log, seed=seed, step=run.trained_steps(name, seed))}
                seeds[seed] = result
                log.info("%s seed %d: %s", task.display, seed, scores_line({s: result[s] for s in task.eval_splits}))
                if test_f:
                    test_predictions[seed] = {key: (f, predict(classifier, programs, f, **predict_kw))
                                              for key, f in test_f.items()}
            medians = seed_medians(task, seeds)
            out = {"models": str(run.path / MODELS / name), "max_seq_len": protocol.max_seq_len,
                   "num_eval_examples": {s: len(ex) for s, ex in evals.items()},
                   **({"eval_cut_from": cut} if cut else {}),
                   "seeds": {str(s): r for s, r in seeds.items()}, "median": medians}
            if test_predictions:
                chosen = median_seed(task, seeds, medians)
                for (t, split), (f, values) in test_predictions[chosen].items():
                    write_predictions(submission_dir, TASKS[t], split, f.idx, values)
                out["submitted_seed"] = chosen
            results["tasks"][name] = out
            results["glue"] = scores(results["tasks"])
            write_results(workdir, results)
    finally:
        run_log.close()
    if submission_dir is not None:
        results["submission"] = finish_submission(submission_dir, workdir / "submission.zip", started_at)
        write_results(workdir, results)
    return results
