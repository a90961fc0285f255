"""Measure pretraining-recipe choices one at a time at a small budget.

    python scripts/recipe_sweep.py --workdir runs/recipe            # every variant, then the table
    python scripts/recipe_sweep.py --workdir runs/recipe --only base,lr_4e-3
    python scripts/recipe_sweep.py --workdir runs/recipe --report    # table only
    python scripts/recipe_sweep.py --workdir runs/recipe --speed     # throughput on an idle machine

Each variant is the baseline below with a few config keys changed; each runs as an
ordinary `python -m roformer.pretrain` in `<workdir>/<variant>` (finished runs are
skipped, interrupted ones resume). The table gives, per variant, the held-out MLM loss
and accuracy at the end (equal tokens) and the held-out loss at equal wall time (the
training time of the slowest variant's budget is cut to that of the fastest-finishing
one, reading each run's loss curve at the tokens it would have seen by then), plus
the vocabulary's unigram loss, since losses under different vocabularies are not
comparable token for token.

Equal wall time needs each variant's throughput, and a sweep that shares the machine with
other work measures it badly. `--speed` times every variant alone for a short run
(SPEED_STEPS steps, median of the logged intervals, compilation and evaluation excluded)
and writes `speed.json`; the table then uses those figures instead of the sweep runs' own.
Variants that differ only in learning rate, warmup or schedule (COST_FREE_KEYS) run the
same step and share one timing.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from roformer import cli  # noqa: E402
from roformer.configs import SCHEME_FILES  # noqa: E402
from roformer.configs.ablation import SHARED_DATA  # noqa: E402
from roformer.model import ModelConfig  # noqa: E402
from roformer.model.positions import POSITION_SCHEMES  # noqa: E402
from roformer.train.metrics import read_metrics  # noqa: E402

# The baseline every variant changes: tiny model, a WordPiece vocabulary trained on
# the corpus, no dropout, sequence 128, batch 32, 700 steps (2.9M tokens).
BASE = {
    "model.size": "tiny",
    "model.hidden_dropout": 0.0,
    "model.attention_dropout": 0.0,
    "data.source": "files",
    "data.files": str(SHARED_DATA / "wikipedia_en" / "wiki_*"),
    "data.vocab": "",
    "data.vocab_size": 8000,
    "train.seq_len": 128,
    "train.batch_size": 32,
    "train.steps": 700,
    "train.learning_rate": 2e-3,
    "train.warmup_steps": 70,
    "train.decay": "linear",
    "train.log_every": 50,
    "train.eval_every": 100,
    "train.eval_batches": 16,
    "train.checkpoint_every": 700,
    "train.progress_bar": False,
}
BERT_VOCAB = str(SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt")

# Half the batch for twice the steps (equal tokens).
BATCH_16 = {"train.batch_size": 16, "train.steps": 1400, "train.warmup_steps": 140, "train.eval_every": 200,
            "train.checkpoint_every": 1400}

# name -> (position scheme, overrides of BASE)
VARIANTS: dict[str, tuple[str, dict]] = {
    "base": ("rope", {}),
    "vocab_bert_30522": ("rope", {"data.vocab": BERT_VOCAB}),
    "vocab_4000": ("rope", {"data.vocab_size": 4000}),
    "vocab_16000": ("rope", {"data.vocab_size": 16000}),
    "dropout_0.1": ("rope", {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}),
    "lr_1e-3": ("rope", {"train.learning_rate": 1e-3}),
    "lr_4e-3": ("rope", {"train.learning_rate": 4e-3}),
    "warmup_0": ("rope", {"train.warmup_steps": 0}),
    "warmup_30pct": ("rope", {"train.warmup_steps": 210}),
    "cosine": ("rope", {"train.decay": "cosine"}),
    "batch_16": ("rope", BATCH_16),
    "batch_64": ("rope", {"train.batch_size": 64, "train.steps": 350, "train.warmup_steps": 35,
                            "train.eval_every": 50, "train.checkpoint_every": 350}),
    "pre_ln": ("rope", {"model.pre_layer_norm": True}),
    "pre_ln_lr_4e-3": ("rope", {"model.pre_layer_norm": True, "train.learning_rate": 4e-3}),
    "learned": ("learned", {}),
    "learned_lr_1e-3": ("learned", {"train.learning_rate": 1e-3}),
    "learned_lr_4e-3": ("learned", {"train.learning_rate": 4e-3}),
    "learned_pre_ln": ("learned", {"model.pre_layer_norm": True}),
    # The two largest single gains together, for rotary and for learned absolute positions.
    "batch_16_vocab_4000": ("rope", {**BATCH_16, "data.vocab_size": 4000}),
    "learned_batch_16": ("learned", BATCH_16),
}


def overrides(variant: str) -> tuple[str, dict]:
    """The variant's pretraining config file and its command-line settings."""
    position, changes = VARIANTS[variant]
    scheme = POSITION_SCHEMES[position]
    settings = {**BASE, **changes}
    if scheme.max_length(ModelConfig(position=position)) is not None:   # a table: exactly the trained length
        settings.setdefault("model.max_position_embeddings", settings["train.seq_len"])
    return SCHEME_FILES[position], settings


def run_variant(variant: str, workdir: Path) -> None:
    config_file, settings = overrides(variant)
    summary = workdir / "summary.json"
    if summary.exists() and json.loads(summary.read_text())["final_step"] >= settings["train.steps"]:
        print(f"{variant}: done, skipping", flush=True)
        return
    cmd = [sys.executable, "-m", "roformer.pretrain", f"--config=configs/{config_file}.py",
           f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in settings.items()]
    print(f"{variant}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


SPEED_STEPS = 80
SPEED_FILE = "speed.json"
# Keys that change what a step computes on, not how long it takes: variants differing only
# in these share one timing.
COST_FREE_KEYS = ("train.learning_rate", "train.warmup_steps", "train.decay", "train.steps",
                  "train.eval_every", "train.checkpoint_every")


def cost_key(variant: str) -> str:
    config_file, settings = overrides(variant)
    return json.dumps([config_file, {k: v for k, v in settings.items() if k not in COST_FREE_KEYS}],
                      sort_keys=True)


def run_vocab(root: Path, variant: str) -> Path:
    """The vocabulary a sweep run trained (and reused by its speed run and unigram loss)."""
    return root / variant / "tokenizer.json"


def measure_speed(variant: str, root: Path) -> float:
    """Median training tokens/s of `variant` over a short run of its own (scratch workdir)."""
    config_file, settings = overrides(variant)
    workdir = root / "_speed" / variant
    shutil.rmtree(workdir, ignore_errors=True)
    settings = {**settings, "train.steps": SPEED_STEPS, "train.warmup_steps": 0, "train.log_every": 10,
                "train.eval_every": SPEED_STEPS, "train.eval_batches": 1,
                "train.checkpoint_every": SPEED_STEPS}
    own_vocab = run_vocab(root, variant)
    if own_vocab.is_file():   # the sweep run's vocabulary, not a new training of one
        settings["data.vocab"] = str(own_vocab)
    cmd = [sys.executable, "-m", "roformer.pretrain", f"--config=configs/{config_file}.py",
           f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in settings.items()]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    rates = [r["tokens_per_sec"] for r in read_metrics(workdir) if isinstance(r.get("tokens_per_sec"), float)]
    shutil.rmtree(workdir, ignore_errors=True)
    return statistics.median(rates)


def curve(rows: list[dict], tokens_per_step: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens seen, held-out loss) at every evaluation, the last row per step winning."""
    evals = {r["step"]: r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), float)}
    steps = sorted(evals)
    return np.array(steps, float) * tokens_per_step, np.array([evals[s] for s in steps])


def unigram_loss(settings: dict) -> tuple[int, float]:
    from roformer.data import DataConfig, make_pretrain_data

    data_cfg = DataConfig.from_mapping({k[5:]: v for k, v in settings.items() if k.startswith("data.")})
    data = make_pretrain_data(data_cfg, seq_len=settings["train.seq_len"], batch_size=1, seed=0,
                              show_progress=False)
    return data.vocab_size, data.unigram_loss()


def _gap(value) -> str:
    """Held-out loss increase when each window's tokens are shuffled (how much order is used)."""
    return "" if value is None else f"{value:.2f}"


def report(root: Path, variants: list[str]) -> str:
    runs = {}
    for v in variants:
        summary_path = root / v / "summary.json"
        if not summary_path.exists():
            continue
        _, settings = overrides(v)
        summary = json.loads(summary_path.read_text())
        tokens_per_step = settings["train.batch_size"] * settings["train.seq_len"]
        tokens, losses = curve(read_metrics(root / v), tokens_per_step)
        total = settings["train.steps"] * tokens_per_step
        runs[v] = {"summary": summary, "tokens": tokens, "losses": losses, "total": total,
                   "train_s": total / summary["tokens_per_sec"], "settings": settings}
    if not runs:
        return "no finished runs\n"
    speed_path = root / SPEED_FILE
    speed = json.loads(speed_path.read_text()) if speed_path.exists() else {}
    for v, r in runs.items():
        if v in speed:   # measured alone (--speed): the sweep's own figure shared the machine
            r["summary"]["tokens_per_sec"] = speed[v]
            r["train_s"] = r["total"] / speed[v]
    budget_s = min(r["train_s"] for r in runs.values())
    vocab_cache: dict[str, tuple[int, float]] = {}
    source = (f"tokens/s measured alone, {SPEED_STEPS}-step runs (--speed)" if speed
              else "tokens/s of the sweep runs themselves")
    lines = [f"Equal wall time: {budget_s:.0f} s of training (the fastest run's whole budget; {source}).", "",
             "| variant | vocab | unigram loss | tokens/s | held-out loss | held-out acc | gain over unigram "
             "| loss at equal wall time | order gap |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v, r in runs.items():
        s = r["summary"]
        # The run's own vocabulary: retraining one is slow and gives a different one
        # (WordPiece training is not deterministic).
        vocab_file = run_vocab(root, v)
        settings = {**r["settings"], "data.vocab": str(vocab_file)}
        key = hashlib.sha256(vocab_file.read_bytes()).hexdigest()
        if key not in vocab_cache:
            vocab_cache[key] = unigram_loss(settings)
        vocab, uni = vocab_cache[key]
        at_budget = float(np.interp(budget_s * s["tokens_per_sec"], r["tokens"], r["losses"]))
        lines.append(f"| {v} | {vocab:,} | {uni:.2f} | {s['tokens_per_sec']:,.0f} | {s['eval_loss']:.3f} | "
                     f"{100 * s['eval_mlm_accuracy']:.1f}% | {uni - s['eval_loss']:.2f} | {at_budget:.3f} | "
                     f"{_gap(s.get('eval_order_gap'))} |")
    return "\n".join(lines) + "\n"


@cli.entry_point
def main() -> None:
    command = cli.CommandFlags(__doc__.split("\n\n")[0])
    command.define("--workdir", required=True, type=Path)
    command.define("--only", many=True, default=list(VARIANTS), choices=list(VARIANTS),
                   help="the variants to run (default: all)")
    command.define("--report", type=bool, help="only write the table")
    command.define("--speed", type=bool,
                   help=f"time each variant alone ({SPEED_STEPS} steps) into {SPEED_FILE}, then the table")
    args, positional = command.parse(sys.argv[1:])
    if positional:
        raise cli.UsageError(f"unexpected arguments: {positional}")
    variants = args.only
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.speed:
        speed_path = args.workdir / SPEED_FILE
        speed = json.loads(speed_path.read_text()) if speed_path.exists() else {}
        timed: dict[str, str] = {}   # cost key -> the variant timed for it
        for v in variants:
            key = cost_key(v)
            twin = timed.get(key)
            speed[v] = speed[twin] if twin else measure_speed(v, args.workdir)
            timed.setdefault(key, v)
            print(f"{v}: {speed[v]:,.0f} tokens/s" + (f" (as {twin}: same step)" if twin else ""), flush=True)
            speed_path.write_text(json.dumps(speed, indent=1))
    elif not args.report:
        for v in variants:
            run_variant(v, args.workdir / v)
    table = report(args.workdir, variants)
    (args.workdir / "recipe.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
