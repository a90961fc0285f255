"""The position-scheme comparison sized for one GPU and a time limit (`configs/study.py:gpu_*`).

Per scheme, one compiled program trains every member at once: `study.seeds` seeds x
`study.learning_rates` rates, stacked on a leading axis and vmapped, each member with its
own initialisation and data order (its seed: every rate of a seed starts alike and sees the
same batches) and its own learning rate (an optimizer-state hyperparameter,
roformer.train.optim.make_member_optimizer). The schedule is warmup-stable-decay: the trunk
trains at the peak rate, and at each budget's cooldown start its state is copied and decayed
to 0 (a branch), so one run gives the end-of-schedule loss of every budget. The data live on
the device (roformer.study.data), so no host work paces a step.

Evaluated at every `eval_every` steps of the trunk: validation loss, the order-horizon
spectrum (loss increase under shuffles within windows and under reversal) and each scheme's
position signal; at every budget's end: validation loss (which chooses the rate) and the
test loss of every test item (a document with its rows; the report's seed x item bootstrap
resamples them). A member whose loss stops being finite, or climbs 1 nat above its first
step's, is recorded as diverged, per budget for the model that budget scores (its trunk up to
the fork, then its branch).

Resumable by scheme: a scheme whose record (DIR/schemes/<scheme>.json, or one in records
archives staged in DIR/incoming: roformer.study.records) has the config's
fingerprint is not trained again, and a record of other settings is set aside, never mixed
with these; the report (roformer.study.report) is rewritten
after every group, on a worker thread while the next group trains (ReportInBackground); the
last of those writes is the final report (the caller writes it only when that one failed or
nothing trained).

With `study.extend_edges`, once every scheme's grid has trained, a scheme whose chosen rate is
at an end of the grid at some budget trains its seeds at one more rate beyond that end (a
second, smaller group, joined to its record member by member), so each scheme's grid brackets
its optimum or the report says it does not. Every scheme gets the same rule.

With `study.compile_ahead` (N > 0), the next N groups' programs are compiled on worker threads
while the device trains the current group (study_train.CompileAhead), so the device does not
wait for each scheme's compilation in turn; a group beyond a grid's edge is known once its
scheme's grid has trained, so it compiles while the last grids train.

The settings, their validation and the memory estimate are roformer.study.plan's,
one scheme's programs and training roformer.study.groups's, the records on disk
roformer.study.records'; here: the splits, the loop over the schemes (`run_study`)
and the commands (`pack`, `stage`, `split`, `report`).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np

from roformer import workdir_kind
from roformer.config_files import fingerprint, split_list
from roformer.study import data as study_data, kept, stats as study_stats
from roformer.study.records import (CONFIG_RECORD, DATA_MANIFEST, SCHEMES_DIR, open_records, save_scheme,
                                             take_finished)
from roformer.study.preregistration import FIELDS as PREREGISTRATION_FIELDS
from roformer.study.plan import StudyPlan, build_plan, check_memory, edge_rates, validate
from roformer.study.groups import CompileAhead, SchemeRun, merge_groups
from roformer.data import DataConfig
from roformer.data.config import without_neutral_settings
from roformer.errors import ConfigError
from roformer.files import write_json_atomic, write_text_atomic

log = logging.getLogger("roformer.study")

# --------------------------------------------------------------------------- the study


# Study keys that change how the study is run or read, not what a scheme's group computes:
# changing them keeps finished schemes. The pre-registration's fields among them ("margin": the
# equivalence margin of configs recorded before it).
REPORT_ONLY_KEYS = ("schemes", "reference", "margin", "order_threshold", "bootstrap", "memory_limit_gib",
                    "time_limit_s", "data_pack", "extend_edges", "compile_ahead", *PREREGISTRATION_FIELDS)


# Train keys that only watch a run and came after study records were first kept: left out, so
# adding one leaves every finished scheme finished (the older ones stay in, for the same reason).
WATCH_ONLY_TRAIN_KEYS = ("profile_steps",)


def scheme_fingerprint(plan: StudyPlan, scheme: str, manifest: dict) -> str:
    """What a scheme's record depends on: its pretraining config (data files by name, not
    where they lie), the study keys that change what it computes, and the data manifest."""
    study = {k: v for k, v in plan.study.to_dict().items() if k not in REPORT_ONLY_KEYS}
    pretrain = plan.pretrain[scheme].to_dict()
    pretrain["data"] = portable_data(pretrain["data"])
    pretrain["train"] = {k: v for k, v in pretrain["train"].items() if k not in WATCH_ONLY_TRAIN_KEYS}
    manifest = {k: v for k, v in manifest.items() if k != "setup_s"}
    return fingerprint(pretrain, study, manifest)


def portable_data(data: dict) -> dict:
    """The data settings without where the files lie (a pack or a record made on one machine is
    read on another, whose checkout sits elsewhere), only their names; nor the cache."""
    data = without_neutral_settings(data)
    for key in ("files", "vocab", "hf_path", "tfds_data_dir"):
        data[key] = os.path.basename(str(data.get(key) or ""))
    for key in ("cache_dir", "num_workers"):
        data.pop(key, None)
    return data


def device_arrays(plan: StudyPlan, data: study_data.StudyData) -> dict:
    """The training data and masking tables on the device, shared by every scheme."""
    seeds = list(range(int(plan.study.seeds)))
    num_rows = data.train["input_ids"].shape[0]
    orders = study_data.pass_orders(seeds, num_rows, study_data.passes_needed(plan.budgets[-1], plan.train.batch_size,
                                                                               num_rows))
    return {"train": {k: jnp.asarray(v) for k, v in data.train.items()}, "orders": jnp.asarray(orders),
            "special": jnp.asarray(data.special), "replacement_ids": jnp.asarray(np.flatnonzero(~data.special),
                                                                                 jnp.int32)}


def data_key(config) -> str:
    """What the splits depend on: the data settings, the sequence length and the split keys.
    Where the files lie is not part of it (the pack is made on one machine and read on
    another, whose checkout sits elsewhere), only their names; nor is the cache."""
    st = config.study
    return fingerprint(portable_data(config.pretrain.data.to_dict()), int(config.pretrain.train.seq_len),
                            {k: st[k] for k in ("test_fraction", "validation_fraction", "validation_rows",
                                                "variant_rows", "windows", "test_mask_draws", "max_test_rows")},
                            study_data.ORDER_VARIANTS, study_data.TEST_ITEM)


def study_splits(plan: StudyPlan) -> study_data.StudyData:
    """The splits: from study.data_pack when given, else built from config.pretrain.data."""
    config, st = plan.config, plan.study
    if st.get("data_pack"):
        if not Path(st.data_pack).is_file():
            raise ConfigError(f"study.data_pack={st.data_pack!r} is not a file: make it with "
                              "`python -m roformer.study pack --config=configs/study.py:VARIANT PATH` where the corpus is")
        return study_data.load_pack(st.data_pack, data_key(config))
    return study_data.build(DataConfig.from_mapping(config.pretrain.data), seq_len=int(config.pretrain.train.seq_len),
                            test_fraction=st.test_fraction, validation_fraction=st.validation_fraction,
                            validation_rows=st.validation_rows, variant_rows=st.variant_rows, windows=list(plan.windows),
                            test_mask_draws=st.test_mask_draws, max_test_rows=st.max_test_rows)


class ReportInBackground:
    """The report rewritten on one worker thread after each group, while the next group trains:
    at a full test set its bootstrap and figures take seconds of host time, which the device
    would otherwise wait out. A request while a write waits to start is covered by that write
    (it reads the latest records). Records are read under `lock`, which the training thread
    holds while it saves one, so a write never pairs one save's record with another's sums. A
    failed write is logged and the next one tries again; `close` gives the last write's report,
    or None when it failed (or none was asked for), and the caller then writes it."""

    def __init__(self, config, workdir: Path, lock: threading.Lock):
        self.config, self.workdir, self.lock = config, workdir, lock
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="report")
        self.queued: Future | None = None
        self.latest: dict | None = None

    def _write(self) -> None:
        from roformer.study import report as study_report
        self.latest = None
        try:
            with self.lock:
                runs = study_report.load(self.workdir)
            self.latest = study_report.write(self.config, self.workdir, runs=runs)
        except Exception:
            log.warning("writing the report on its worker thread failed; the next write tries again", exc_info=True)

    def request(self) -> None:
        if self.queued is None or self.queued.running() or self.queued.done():
            self.queued = self.pool.submit(self._write)

    def close(self) -> dict | None:
        """Wait for the write under way, if any; the report of the last write, which began after
        the last request (so after every record saved before it), when that write succeeded."""
        self.pool.shutdown(wait=True)
        return self.latest


# The exit status of `python -m roformer.study` when study.time_limit_s stopped the study before
# its last group: the report covers what finished, and the same command trains the rest.
PARTIAL_EXIT = 3


def run_study(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Train (or resume) every scheme of config.study in `workdir` and write the report; returns it."""
    from roformer.study import report as study_report  # matplotlib and scipy: when a report is written

    plan = build_plan(config)
    validate(plan)
    workdir = Path(workdir).resolve()
    workdir_kind.claim(workdir, workdir_kind.STUDY)   # before anything is written
    (workdir / SCHEMES_DIR).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data, estimates = _checked_data(plan)
    keeper = kept.Keeper.start(workdir, plan, data)   # the downstream arm's members, when the config keeps them
    log.info("data ready in %.0f s: %s; memory estimate per group %s", time.perf_counter() - t0,
             json.dumps(data.manifest), {k: f"{v / 2**30:.2f} GiB" for k, v in estimates.items()})
    # Recorded once the settings passed every check, so a run refused at its start leaves the
    # config its records were trained under.
    workdir_kind.record(workdir, workdir_kind.STUDY)
    write_text_atomic(workdir / CONFIG_RECORD, config.to_json_best_effort(indent=2) + "\n")
    write_json_atomic(workdir / DATA_MANIFEST, {**data.manifest, "setup_s": time.perf_counter() - t0})
    fingerprints = {scheme: scheme_fingerprint(plan, scheme, data.manifest) for scheme in plan.schemes}
    finished = take_finished(workdir, fingerprints)
    groups = _Groups(plan, data, workdir, t0, keeper)
    try:
        for scheme in plan.schemes:
            if scheme in finished:
                groups.list_edges(scheme)
        complete = groups.train_grids([scheme for scheme in plan.schemes if scheme not in finished], fingerprints,
                                      estimates)
        if complete:   # every scheme's grid first, so the comparison is whole before any group beyond a grid trains
            groups.train_edges()
    finally:
        groups.ahead.close()
        written = groups.report.close()
    # The last write on the worker began after the last record was saved: it is the final
    # report, unless it failed or nothing was trained.
    return written if written is not None else study_report.write(config, workdir)


def _checked_data(plan: StudyPlan) -> tuple[study_data.StudyData, dict[str, int]]:
    """The splits, refused when the test split is too small, and each scheme's memory estimate
    (refused when a group would not fit)."""
    data = study_splits(plan)
    if data.test_predictions < plan.study.min_test_predictions:
        raise ConfigError(f"the test split holds {data.test_predictions} masked predictions, fewer than "
                          f"study.min_test_predictions={plan.study.min_test_predictions}: raise study.test_fraction "
                          "or study.test_mask_draws")
    return data, check_memory(plan, data)


class _Groups:
    """The session's groups: prepared ahead (study.compile_ahead), trained in turn, each
    refused a start it could not finish within study.time_limit_s, saved as a record and
    followed by a report; then the groups beyond the grids' edges (study.extend_edges)."""

    def __init__(self, plan: StudyPlan, data: study_data.StudyData, workdir: Path, t0: float,
                 keeper: kept.Keeper | None = None):
        self.plan, self.data, self.workdir, self.t0, self.keeper = plan, data, workdir, t0, keeper
        self.test_weight = study_stats.item_sums(np.zeros((1, len(data.test_items))),
                                                 data.test["masked_weights"].sum(-1), data.test_items)[1]
        # The forecast of a group's time: the longest any group took once its programs were
        # compiled, plus the longest compilation unless the group's programs are compiled already
        # (on a worker thread): a group compiled ahead does not wait for them.
        self.longest = {"run": 0.0, "programs": 0.0}
        self.aux: dict = {}   # the data on the device: put there by this thread, once a group needs it
        self.ahead = CompileAhead(self.prepare, int(plan.study.compile_ahead))
        self.saving = threading.Lock()
        self.report = ReportInBackground(plan.config, workdir, self.saving)
        # The groups beyond the grids' edges: (scheme, its record and test sums, the rates beyond
        # its grid, their group), listed as each scheme's grid is known, so the first of them can
        # compile ahead while the last grids train.
        self.edges: list[tuple] = []

    def out_of_time(self, what: str, key) -> bool:
        st, elapsed = self.plan.study, time.perf_counter() - self.t0
        compiling = 0.0 if self.ahead.ready(key) else self.longest["programs"]
        if st.time_limit_s and self.longest["run"] and elapsed + self.longest["run"] + compiling > st.time_limit_s:
            log.warning("time limit: %s and what follows not started (%.0f s gone; a group took up to %.0f s once "
                        "compiled%s; study.time_limit_s=%.0f); the same command resumes with them", what, elapsed,
                        self.longest["run"], f", and compiling up to {compiling:.0f} s" if compiling else
                        ", and its programs are compiled", st.time_limit_s)
            return True
        return False

    def device_data(self) -> None:
        if not self.aux:
            self.aux.update(device_arrays(self.plan, self.data))

    def prepare(self, scheme: str, group=None) -> SchemeRun:
        return SchemeRun(self.plan, scheme, self.data, self.aux, group).compile()

    def submit(self, key, *args) -> None:
        self.device_data()
        self.ahead.submit(key, *args)

    def train(self, key, *args):
        """Train the group prepared under `key` (waiting for it, or preparing it now)."""
        self.device_data()
        waited = time.perf_counter()
        run = self.ahead.take(key, *args)
        waited = time.perf_counter() - waited
        record, test_loss = run.run()
        t = record["timing"]
        self.longest["run"] = max(self.longest["run"], t["wall_s"])   # from its programs ready to its record
        self.longest["programs"] = max(self.longest["programs"], t["programs_s"])
        t["programs_wait_s"] = waited
        t["wall_s"] += waited
        log.info("%s: %d members done in %.0f s (set-up %.0f s, programs and initial states %s, first evaluation "
                 "%.0f s, first chunk %.0f s, training %.0f s, evaluation %.0f s, %.0f tokens/s in all)",
                 run.scheme, len(record["members"]), t["wall_s"], t["setup_s"],
                 f"compiled ahead in {t['programs_s']:.0f} s, waited {waited:.0f} s" if run.compiled_ahead
                 else f"compiled here in {t['programs_s']:.0f} s", t["first_eval_s"], t["compile_s"], t["train_s"],
                 t["eval_s"], t["tokens_per_s"])
        return record, test_loss, run.params

    def save(self, scheme: str, record: dict, arrays: dict, params, group) -> None:
        """The scheme's record and test sums, then the members the downstream arm keeps (the
        choice may have moved to a rate beyond the grid)."""
        with self.saving:
            save_scheme(self.workdir, scheme, record, arrays)
        if self.keeper:
            self.keeper.keep(scheme, record, params, group)
        self.report.request()

    def list_edges(self, scheme: str) -> None:
        from roformer.study import report as study_report

        if not self.plan.study.extend_edges:
            return
        record, arrays = study_report.load_scheme(self.workdir, scheme)
        trained = sorted({m["rate"] for m in record["members"]})
        extra = edge_rates(trained, [study_report.choose_rate(record, b) for b in record["budgets"]])
        if "edges" not in record and extra:
            self.edges.append((scheme, (record, arrays), extra,
                               self.plan.members(extra, first_index=len(record["members"]))))

    def train_grids(self, todo: list[str], fingerprints: dict[str, str], estimates: dict[str, int]) -> bool:
        """Each scheme's grid in `todo`, in turn; whether all of them trained (none out of time)."""
        for k, scheme in enumerate(todo):
            if self.out_of_time(scheme, scheme):
                return False
            following = [(later, (later,)) for later in todo[k + 1:]] + \
                [(("edges", later), (later, group)) for later, _, _, group in self.edges]
            for key, args in following[:self.ahead.groups]:
                self.submit(key, *args)
            record, test_loss, params = self.train(scheme, scheme)
            record.update(fingerprint=fingerprints[scheme], memory_estimate_bytes=estimates[scheme])
            self.save(scheme, record, {"test_weight": self.test_weight, **test_loss}, params, self.plan.members())
            del params
            self.list_edges(scheme)
        return True

    def train_edges(self) -> None:
        """The groups beyond the grids' edges, each joined to its scheme's record."""
        for k, (scheme, (record, arrays), extra, group) in enumerate(self.edges):
            if self.out_of_time(f"{scheme}'s rates beyond the grid", ("edges", scheme)):
                break
            for later, _, _, later_group in self.edges[k + 1:k + 1 + self.ahead.groups]:
                self.submit(("edges", later), later, later_group)
            log.info("%s: a budget chose a rate at the edge of the grid: training %s too", scheme, extra)
            edge, edge_loss, params = self.train(("edges", scheme), scheme, group)
            record, arrays = merge_groups(record, arrays, edge, edge_loss)
            record["edges"] = {"rates": extra, "members": len(edge["members"]), "timing": edge["timing"]}
            self.save(scheme, record, arrays, params, group)
            del params


def write_report(source: Path, into: Path | None = None) -> Path:
    """The report of a study's finished schemes, from their records and the config the study
    recorded (study_config.json), without training: after a run stopped before its last write,
    or where only the records were kept. `source` is a study workdir (the report is written
    there) or records archives (`open_records`; the report is written in `into`). Returns the
    report's path."""
    from roformer.study import report as study_report

    if not (source / CONFIG_RECORD).is_file() and into is None:
        raise ConfigError(f"{source} has no {CONFIG_RECORD}: not a study workdir; for records archives (such as "
                          "scripts/gpu_comparison.sh's records.tar.gz) name a directory to write the report in")
    workdir = open_records(source, into)
    config = ml_collections.ConfigDict(json.loads((workdir / CONFIG_RECORD).read_text()))
    if "equivalence_margin" not in config.study:
        # A registration written after the records were scored would not be one.
        raise ConfigError(f"{CONFIG_RECORD} predates the pre-registration (no study.equivalence_margin, tuning_seeds, "
                          "scored_seeds): its report is the one written with the records")
    manifest = json.loads((workdir / DATA_MANIFEST).read_text()) if (workdir / DATA_MANIFEST).is_file() else None
    records = study_report.load(workdir)
    schemes = split_list(config.study.schemes)
    # Archives of calls that ran other schemes (a key that keeps finished ones) hold records
    # the last archive's config does not list: planned too, to check their fingerprints.
    config.study.schemes = ",".join(schemes + [scheme for scheme in records if scheme not in schemes])
    plan, runs = build_plan(config), {}
    for scheme, run in records.items():
        if manifest is not None and run[0].get("fingerprint") != scheme_fingerprint(plan, scheme, manifest):
            print(f"{scheme}: its record was trained under other settings than {CONFIG_RECORD}'s: not reported")
        else:
            runs[scheme] = run
    # Archives of runs that ran other schemes (a key that keeps finished ones) hold records
    # the last archive's config does not list.
    unlisted = [scheme for scheme in runs if scheme not in schemes]
    if unlisted:
        print(f"{', '.join(unlisted)}: finished under these settings, not listed in study.schemes of the "
              f"{CONFIG_RECORD} read: reported after the listed ones")
    config.study.schemes = ",".join(schemes + unlisted)
    study_report.write(config, workdir, runs=runs)
    return workdir / study_report.REPORT_MD


def make_pack(config: ml_collections.ConfigDict, path: str | Path) -> str:
    """The splits of `config` into a pack at `path` for a machine without the corpus
    (scripts/gpu_comparison.sh reads .device/study_data/wikipedia_en.npz, which
    scripts/device_files.sh makes); left as it is when it was made with the same settings.
    Returns what was done, in a line."""
    plan = build_plan(config)
    validate(plan)
    config.study.data_pack = ""
    if study_data.pack_key(path) == data_key(config):
        return f"{path}: up to date (made with this config's data and split settings)"
    data = study_splits(plan)
    study_data.save_pack(data, path, data_key(config))
    return f"{path}: {json.dumps(data.manifest)}"
