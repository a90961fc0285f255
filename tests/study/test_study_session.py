"""The study's loop (roformer/study/session.py): the fingerprint that keeps a finished
scheme, the time limit and its forecast, compiling ahead and writing the report on worker
threads, with stand-in groups that train nothing."""
import numpy as np
import pytest

from helpers.study import config
from roformer.errors import ConfigError
from roformer.study import plan as study_plan
from roformer.study import session as study


def test_a_schemes_fingerprint_does_not_depend_on_where_the_data_lie():
    """Records made with the checkout in one place resume with it in another (a fresh machine's)."""
    manifest = {"num_docs": 3, "setup_s": 1.0}
    here, there = config("gpu_tiny"), config("gpu_tiny")
    here.pretrain.data.files, there.pretrain.data.files = "/one/place/wiki_*", "/another/place/wiki_*"
    there.pretrain.data.cache_dir = "/elsewhere/cache"
    assert study.scheme_fingerprint(study_plan.build_plan(here), "rope", manifest) == study.scheme_fingerprint(study_plan.build_plan(there), "rope", manifest)
    assert study.scheme_fingerprint(study_plan.build_plan(here), "rope", manifest) == study.scheme_fingerprint(study_plan.build_plan(here), "rope", {"num_docs": 3})
    there.pretrain.data.files = "/one/place/other_*"
    assert study.scheme_fingerprint(study_plan.build_plan(here), "rope", manifest) != study.scheme_fingerprint(study_plan.build_plan(there), "rope", manifest)


def test_a_study_refused_at_its_start_leaves_the_config_its_records_were_trained_under(tmp_path):
    (tmp_path / study.SCHEMES_DIR).mkdir()
    (tmp_path / study.CONFIG_RECORD).write_text("the earlier call's\n")
    with pytest.raises(ConfigError, match="min_test_predictions"):
        study.run_study(config(min_test_predictions=10**9), tmp_path)
    assert (tmp_path / study.CONFIG_RECORD).read_text() == "the earlier call's\n"


class StandInRun:
    """A scheme's group for the study's loop that trains nothing: an empty record with the
    timing `wall_s` and `programs_s` give, and zero test sums."""
    compiled_ahead = False
    wall_s = programs_s = 0.0
    params = None   # no members: a study that keeps members keeps none of these

    def __init__(self, plan, scheme, data, aux, group=None):
        self.scheme, self.budgets, self.key = scheme, plan.budgets, (scheme, group is not None)

    def compile(self):
        return self

    def run(self):
        timing = {**dict.fromkeys(("setup_s", "first_eval_s", "compile_s", "train_s", "eval_s", "tokens_per_s"), 0.0),
                  "wall_s": self.wall_s, "programs_s": self.programs_s}
        return {"scheme": self.scheme, "members": [], "timing": timing}, \
            {f"budget{b}": np.zeros((4, 1), np.float32) for b in self.budgets}


def test_a_study_stopped_by_its_time_limit_resumes_with_the_rest(tmp_path, monkeypatch, caplog):
    """A scheme that would end past study.time_limit_s is not started; the same command (here
    without the limit) trains only the schemes that have no record yet."""
    from roformer.study import report as study_report

    trained = []

    class FakeRun(StandInRun):
        wall_s = 1e6

        def run(self):
            trained.append(self.scheme)
            return super().run()

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study_report, "write", lambda config, workdir, runs=None: {})
    c = config(time_limit_s=60.0, extend_edges=False)
    with caplog.at_level("WARNING", logger="roformer.study"):
        study.run_study(c, tmp_path)
    assert trained == ["rope"] and "alibi and what follows not started" in caplog.text
    c.study.time_limit_s = 0.0
    study.run_study(c, tmp_path)
    assert trained == ["rope", "alibi", "sinusoidal"]
    assert sorted(p.name for p in (tmp_path / study.SCHEMES_DIR).glob("*.json")) == \
        ["alibi.json", "rope.json", "sinusoidal.json"]


@pytest.mark.parametrize("groups", [0, 1])
def test_the_time_limit_counts_a_compilation_only_for_a_group_not_compiled_yet(tmp_path, monkeypatch, caplog, groups):
    """The forecast of the next group is the longest group's run once compiled (60 s here),
    plus the longest compilation (50 s) unless the next group's programs were compiled ahead:
    under a 100 s limit, compiling in turn stops after the first scheme, compiling ahead does not."""
    import threading

    from roformer.study import report as study_report

    trained, compiled = [], {scheme: threading.Event() for scheme in ("rope", "alibi", "sinusoidal")}

    class FakeRun(StandInRun):
        wall_s, programs_s = 60.0, 50.0

        def compile(self):
            compiled[self.scheme].set()
            return self

        def run(self):
            trained.append(self.scheme)
            if groups:   # the next group's compilation, on its worker thread, ends before this group does
                following = list(compiled)[len(trained):len(trained) + 1]
                assert all(compiled[s].wait(30) for s in following)
            return super().run()

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study_report, "write", lambda config, workdir, runs=None: {})
    with caplog.at_level("WARNING", logger="roformer.study"):
        study.run_study(config(time_limit_s=100.0, extend_edges=False, compile_ahead=groups), tmp_path)
    if groups:
        assert trained == ["rope", "alibi", "sinusoidal"] and "time limit" not in caplog.text
    else:
        assert trained == ["rope"]
        assert "alibi and what follows not started" in caplog.text and "compiling up to 50 s" in caplog.text


@pytest.mark.parametrize("groups", [0, 1, 2])
def test_groups_are_compiled_on_worker_threads_at_most_compile_ahead_groups_early(tmp_path, monkeypatch, groups):
    """Each scheme's group (and each group beyond a grid) is prepared on a worker thread once
    at most `study.compile_ahead` groups are left before it, never in the training thread
    unless compile_ahead is 0 or it is the first group: the first group beyond a grid too,
    while the last grids train."""
    import threading

    from roformer.study import report as study_report

    trained, prepared = [], {}

    class FakeRun(StandInRun):
        def compile(self):
            prepared[self.key] = (threading.current_thread().name, len(trained))
            return self

        def run(self):
            trained.append(self.key)
            return super().run()

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study, "edge_rates", lambda trained_rates, chosen: [1.0])
    monkeypatch.setattr(study, "merge_groups", lambda record, arrays, edge, edge_loss: (record, arrays))
    monkeypatch.setattr(study_report, "write", lambda config, workdir, runs=None: {})
    monkeypatch.setattr(study_report, "choose_rate", lambda record, budget: 0)
    monkeypatch.setattr(study_report, "load_scheme", lambda workdir, scheme: ({"members": [], "budgets": []}, {}))
    study.run_study(config(time_limit_s=0.0, compile_ahead=groups), tmp_path)
    order = [(s, False) for s in ("rope", "alibi", "sinusoidal")] + [(s, True) for s in ("rope", "alibi", "sinusoidal")]
    assert trained == order
    for turn, key in enumerate(order):
        thread, done_before = prepared[key]
        ahead = groups and turn != 0
        assert thread.startswith("compile-ahead") == bool(ahead), (key, thread)
        assert done_before >= turn - groups, key


@pytest.mark.parametrize("last_fails", [False, True])
def test_the_report_is_written_on_a_worker_thread_while_the_next_group_trains(tmp_path, monkeypatch, caplog,
                                                                              last_fails):
    """After each group the report is rewritten on its worker thread while the next group trains
    (the next group waits here until that write has begun). A write that fails there is logged,
    and the study goes on. The worker's last write sees every scheme and is the study's report;
    only when it failed does the calling thread write it again."""
    import threading

    from roformer.study import report as study_report

    writes, begun = [], {scheme: threading.Event() for scheme in ("rope", "alibi", "sinusoidal")}

    class FakeRun(StandInRun):
        def run(self):
            before = {"alibi": "rope", "sinusoidal": "alibi"}.get(self.scheme)
            if before:   # the write after the group before has begun while this group trains
                assert begun[before].wait(30)
            return super().run()

    def write(config, workdir, runs=None):
        runs = study_report.load(workdir) if runs is None else runs
        writes.append((threading.current_thread().name, sorted(runs)))
        for scheme in runs:
            begun[scheme].set()
        if len(writes) == 1 or (last_fails and len(runs) == 3 and writes[-1][0].startswith("report")):
            raise RuntimeError("a failed write")
        return {"written": len(writes)}

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study_report, "write", write)
    with caplog.at_level("WARNING", logger="roformer.study"):
        result = study.run_study(config(time_limit_s=0.0, extend_edges=False), tmp_path)
    assert writes[0] == (writes[0][0], ["rope"]) and writes[0][0].startswith("report")
    assert "writing the report on its worker thread failed" in caplog.text and "a failed write" in caplog.text
    on_worker = [w for w in writes if w[0].startswith("report")]
    assert on_worker[-1][1] == ["alibi", "rope", "sinusoidal"]
    if last_fails:
        assert writes[-1] == (threading.current_thread().name, ["alibi", "rope", "sinusoidal"])
    else:
        assert writes[-1] == on_worker[-1]
    assert result == {"written": len(writes)}


def test_a_finished_scheme_is_kept_when_only_how_the_study_is_read_changes():
    c = config()
    fp = study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1})
    c.study.equivalence_margin, c.study.time_limit_s, c.study.data_pack, c.study.schemes = 0.1, 100.0, "x.npz", "rope"
    c.study.tuning_seeds, c.study.scored_seeds, c.study.planning_seed_sds = "1", "0", "0.1"
    c.study.extend_edges, c.study.compile_ahead = not c.study.extend_edges, 0
    assert study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1}) == fp
    c.study.learning_rates = "1e-3,3e-3"
    assert study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1}) != fp


def test_a_schemes_fingerprint_ignores_train_profile_steps():
    """Tracing a window of steps only watches a run: a study's finished schemes stay finished
    whether it is set or not."""
    c = config()
    fp = study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1})
    c.pretrain.train.profile_steps = "2:3"
    assert study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1}) == fp
