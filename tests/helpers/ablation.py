"""What the ablation's tests share: the smoke-size config, fake stage runners that write what
the real ones write, stub figures, and the real side-by-side runs' config, kill and readers."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from roformer.ablation import plan, report
from roformer.ablation.stages import STAGE_RUNNERS, Preempted
from roformer.train.metrics import read_metrics
from roformer.workdir_lock import process_state

from helpers import REPO_ROOT, patient


def small_config(schemes="learned,rope", *, seeds=None, methods=None):
    """configs/ablation.py:smoke: 2 seeds, 40 steps, MRPC, context extension of rope at 2x
    (10 steps, evaluated every 5) under every extension method (`schemes`, `methods`: comma lists)."""
    config = plan.load_config_file("ablation", "smoke")
    config.schemes = tuple(schemes.split(","))
    if seeds is not None:
        config.seeds = seeds
    if methods is not None:
        config.extension.methods = tuple(methods.split(","))
    return config


def run_name(workdir):
    """The ablation's name of the run a stage works in: <scheme>/seed<k> (pretrain/ and
    glue/ workdirs) or extension/<method>/seed<k>."""
    parts = workdir.parts
    return "/".join(parts[-3:]) if parts[-3] == "extension" else "/".join(parts[-2:])


SPEED = {"learned": 1000.0, "rope": 800.0}   # tokens/s; any other scheme 500


class FakeStages:
    """Stage runners that record their calls and write (or return) what the real ones do.

    `values[(scheme, seed)]` sets final held-out metrics of a pretraining run (eval_loss,
    eval_mlm_accuracy, eval_order_gap); `extension_loss[(method, seed)]` the held-out loss
    of an extension run at each evaluated step."""

    def __init__(self, fail=(), preempt=(), values=None, extension_loss=None):
        self.calls = []               # (run, stage), in call order
        self.configs = {}             # (run, stage) -> the config a training stage was given
        self.fail = set(fail)         # {(run, stage)}: raises RuntimeError
        self.preempt = set(preempt)   # {(run, stage)}: raises Preempted (training saved on SIGTERM)
        self.values = values or {}
        self.extension_loss = extension_loss or {}

    def _check(self, run, stage):
        self.calls.append((run, stage))
        if (run, stage) in self.preempt:
            raise Preempted(f"{run} {stage} preempted")
        if (run, stage) in self.fail:
            raise RuntimeError(f"injected failure in {run} {stage}")

    def final(self, scheme, seed):
        default = {"eval_loss": (7.0 if scheme == "rope" else 7.5) + 0.1 * seed,
                   "eval_mlm_accuracy": 0.1 + 0.01 * seed,
                   "eval_order_gap": 0.5 if scheme == "rope" else 0.3}
        return {**default, **self.values.get((scheme, seed), {})}

    def pretrain(self, cfg, workdir):
        run = run_name(workdir)
        self._check(run, "pretrain")
        self.configs[(run, "pretrain")] = cfg
        scheme, seed = workdir.parent.name, cfg.train.seed
        final = self.final(scheme, seed)
        steps, every = cfg.train.steps, cfg.train.eval_every
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir / "metrics.jsonl", "a") as f:
            for step in range(5, steps + 1, 5):
                f.write(json.dumps({"step": step, "loss": 8.0 - step / 10, "mlm_accuracy": step / 100,
                                    "tokens_per_sec": SPEED.get(scheme, 500.0)}) + "\n")
            # Held-out evaluation (with the shuffle probe) every eval_every steps and at the end.
            for step in sorted(set(range(every, steps + 1, every)) | {steps}):
                frac = step / steps
                loss, gap = final["eval_loss"] + (1 - frac), final["eval_order_gap"] * frac
                # Attention stats as the loop logs them: a local head forms, positions decollapse.
                stats = {"eval_attention_distance_l0h0": 10.0 - 8 * frac, "eval_attention_distance_l0h1": 12.0,
                         "eval_hidden_cosine_l0": 0.5, "eval_hidden_cosine_l1": 0.9 - 0.5 * frac}
                f.write(json.dumps({"step": step, "eval_loss": loss,
                                    "eval_mlm_accuracy": final["eval_mlm_accuracy"] * frac,
                                    "eval_shuffled_loss": loss + gap, "eval_order_gap": gap, **stats}) + "\n")
        return {"steps": steps}

    def extrapolation(self, the_plan, pretrain_cfg, pretrain_dir):
        run = run_name(pretrain_dir)
        self._check(run, "extrapolation")
        scheme, seed = pretrain_dir.parent.name, pretrain_cfg.train.seed
        lengths = [64, 128, 256]
        loss = {"plain": [7.0, None, None] if scheme == "learned" else [7.0, 7.4 + 0.1 * seed, 7.9]}
        if scheme == "rope":
            loss.update(linear=[7.0, 7.2, 7.5], ntk=[7.0, 7.1, 7.3], yarn=[7.0, 7.05, 7.2])
        return {"params": 1000, "extrapolation": {"lengths": lengths, "rows": [8, 8, 8], "loss": loss}}

    def glue(self, cfg, workdir):
        self._check(run_name(workdir), "glue")
        workdir.mkdir(parents=True, exist_ok=True)
        results = {"tasks": {"mrpc": {"median": {"dev": {"f1": 0.8, "accuracy": 0.7}}}},
                   "glue": {"glue_bert_9": {"score": 80.0, "complete": False}}}
        (workdir / "glue_results.json").write_text(json.dumps(results))
        return {}

    def extension(self, cfg, workdir):
        run = run_name(workdir)
        self._check(run, "extension")
        self.configs[(run, "extension")] = cfg
        workdir.mkdir(parents=True, exist_ok=True)
        return {"steps": cfg.train.steps}

    def extension_eval(self, the_plan, pretrain_cfg, workdir):
        run = run_name(workdir)
        self._check(run, "extension_eval")
        self.configs[(run, "extension_eval")] = pretrain_cfg
        method, seed = workdir.parent.name, pretrain_cfg.train.seed
        ext = the_plan.config.extension
        steps = list(range(0, ext.steps + 1, ext.eval_every))
        loss = self.extension_loss.get((method, seed)) or [7.4 - 0.1 * i for i in range(len(steps))]
        return {"length": pretrain_cfg.train.seq_len * ext.factor, "steps": steps, "loss": loss,
                "accuracy": [0.1] * len(steps)}

    def install(self, monkeypatch):
        for stage in ("pretrain", "extrapolation", "glue", "extension", "extension_eval"):
            monkeypatch.setitem(STAGE_RUNNERS, stage, getattr(self, stage))


def stub_figures(monkeypatch):
    """The report's figures as stubs that record what they were given and write a placeholder:
    the ablation rewrites its report after every run, and drawing costs about a second each
    time. For the tests about orchestration and statistics; the real figures are drawn in
    tests/ablation/test_ablate.py (the report test) and tests/test_notebooks.py."""
    drawn = []

    def stub(name):
        def plot(result, out_path=None):
            drawn.append((name, out_path))
            if out_path is not None:
                Path(out_path).write_bytes(b"png")
        return plot

    for name in ("plot_loss_curves", "plot_extrapolation", "plot_extension", "plot_attention"):
        monkeypatch.setattr(report, name, stub(name))
    return drawn


def tiny_config(parallel):
    """Two pretraining runs (learned, rope; one seed) of 40 steps at the smoke size, a checkpoint
    every 10, held-out loss every 20; no GLUE, extension or extra extrapolation lengths."""
    config = small_config(seeds=1)
    config.parallel = parallel
    config.glue.task = ""
    config.extension.enabled = False
    config.extrapolation.factors = (1,)
    config.extrapolation.scalings = ()
    config.extrapolation.num_docs = 2
    pre = config.pretrain.train
    config.budget_tokens = 40 * pre.batch_size * pre.seq_len
    pre.eval_every, pre.checkpoint_every, pre.log_every = 20, 10, 10
    pre.progress_bar = False
    # A vocabulary trained on the corpus, small: the BERT vocabulary's 30,522-row table made
    # every checkpoint of the 40 steps a 50 MB save.
    config.pretrain.data.vocab = ""
    config.pretrain.data.vocab_size = 1000
    config.pretrain.mesh.num_devices = 1   # one of the 8 virtual test devices: a smaller program
    return config


def overrides(config):
    """The command-line flags that give `config` from configs/ablation.py:smoke."""
    pre = config.pretrain.train
    flags = {"schemes": config.schemes, "seeds": config.seeds, "parallel": config.parallel,
             "vmap_seeds": config.vmap_seeds, "progress_every_s": config.progress_every_s, "glue.task": "",
             "extension.enabled": False, "extrapolation.factors": "1", "extrapolation.scalings": "()",
             "extrapolation.num_docs": 2, "budget_tokens": config.budget_tokens,
             "pretrain.data.vocab": config.pretrain.data.vocab,
             "pretrain.data.vocab_size": config.pretrain.data.vocab_size,
             "pretrain.mesh.num_devices": config.pretrain.mesh.num_devices,
             "pretrain.train.eval_every": pre.eval_every, "pretrain.train.checkpoint_every": pre.checkpoint_every,
             "pretrain.train.log_every": pre.log_every, "pretrain.train.progress_bar": False}
    return [f"--config.{k}={v}" for k, v in flags.items()]


def kill_after_first_checkpoints(workdir, config, runs):
    """Start the ablation as a command, SIGKILL it once every run in `runs` saved step 10."""
    command = [sys.executable, "-m", "roformer.ablate", "--config=configs/ablation.py:smoke",
               f"--workdir={workdir}", *overrides(config)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + patient(300)
    while not all((workdir / "pretrain" / run / "checkpoints" / "10").is_dir() for run in runs):
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.1)
    # The command line gave the config the test resumes with.
    assert json.loads((workdir / "ablation_config.json").read_text()) == json.loads(config.to_json_best_effort())
    holders = [json.loads((workdir / "pretrain" / run / "workdir.lock").read_text())["pid"] for run in runs]
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.time() + patient(30)
    # The runs' processes die with the ablation (exited: gone, or a zombie until init reaps it).
    while any(process_state(pid) not in (None, "Z", "X") for pid in holders):
        assert time.time() < deadline, "a run's process outlived the ablation"
        time.sleep(0.1)


def why_failed(workdir, result):
    """The errors of the failed runs with their tracebacks and the tails of their logs."""
    parts = [f"{r['scheme']}/seed{r['seed']}: {r.get('error')}" for r in result["runs"] if r["status"] != "done"]
    for path in sorted((workdir / "errors").glob("*.txt")) + sorted((workdir / "logs").glob("*.log")):
        parts.append(f"--- {path.name}\n{path.read_text()[-4000:]}")
    return "\n".join(parts)


def held_out_losses(workdir, runs):
    out = {}
    for run in runs:
        rows = read_metrics(workdir / "pretrain" / run / "metrics.jsonl")
        out[run] = {row["step"]: row["eval_loss"] for row in rows if "eval_loss" in row}
    return out
