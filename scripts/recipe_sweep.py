"""Measure pretraining-recipe choices one at a time at a small budget.

    python scripts/recipe_sweep.py --workdir runs/recipe            # every variant, then the table
    python scripts/recipe_sweep.py --workdir runs/recipe --only base,lr_4e-3
    python scripts/recipe_sweep.py --workdir runs/recipe --report    # table only

Each variant is the baseline below with a few config keys changed; each runs as an
ordinary `python -m roformer.pretrain` in `<workdir>/<variant>` (finished runs are
skipped, interrupted ones resume). The table gives, per variant, the held-out MLM loss
and accuracy at the end (equal tokens) and the held-out loss at equal wall time (the
training time of the slowest variant's budget is cut to that of the fastest-finishing
one, reading each run's loss curve at the tokens it would have seen by then), plus
the vocabulary's unigram loss, since losses under different vocabularies are not
comparable token for token.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configs.ablation import SHARED_DATA  # noqa: E402
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

# name -> (scheme config file, overrides of BASE)
VARIANTS: dict[str, tuple[str, dict]] = {
    "base": ("rotary", {}),
    "vocab_bert_30522": ("rotary", {"data.vocab": BERT_VOCAB}),
    "vocab_4000": ("rotary", {"data.vocab_size": 4000}),
    "vocab_16000": ("rotary", {"data.vocab_size": 16000}),
    "dropout_0.1": ("rotary", {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}),
    "lr_1e-3": ("rotary", {"train.learning_rate": 1e-3}),
    "lr_4e-3": ("rotary", {"train.learning_rate": 4e-3}),
    "warmup_0": ("rotary", {"train.warmup_steps": 0}),
    "warmup_30pct": ("rotary", {"train.warmup_steps": 210}),
    "cosine": ("rotary", {"train.decay": "cosine"}),
    "batch_16": ("rotary", {"train.batch_size": 16, "train.steps": 1400, "train.warmup_steps": 140,
                            "train.eval_every": 200, "train.checkpoint_every": 1400}),
    "batch_64": ("rotary", {"train.batch_size": 64, "train.steps": 350, "train.warmup_steps": 35,
                            "train.eval_every": 50, "train.checkpoint_every": 350}),
    "pre_ln": ("rotary", {"model.pre_layer_norm": True}),
    "pre_ln_lr_4e-3": ("rotary", {"model.pre_layer_norm": True, "train.learning_rate": 4e-3}),
    "learned": ("absolute", {}),
    "learned_lr_1e-3": ("absolute", {"train.learning_rate": 1e-3}),
    "learned_lr_4e-3": ("absolute", {"train.learning_rate": 4e-3}),
    "learned_pre_ln": ("absolute", {"model.pre_layer_norm": True}),
}


def overrides(variant: str) -> tuple[str, dict]:
    config_file, changes = VARIANTS[variant]
    settings = {**BASE, **changes}
    if config_file == "absolute":   # the table covers exactly the trained length
        settings.setdefault("model.max_position_embeddings", settings["train.seq_len"])
    return config_file, settings


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
    budget_s = min(r["train_s"] for r in runs.values())
    vocab_cache: dict[tuple, tuple[int, float]] = {}
    lines = [f"Equal wall time: {budget_s:.0f} s of training (the fastest run's whole budget).", "",
             "| variant | vocab | unigram loss | tokens/s | held-out loss | held-out acc | gain over unigram "
             "| loss at equal wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for v, r in runs.items():
        s = r["summary"]
        key = (r["settings"]["data.vocab"], r["settings"]["data.vocab_size"])
        if key not in vocab_cache:
            vocab_cache[key] = unigram_loss(r["settings"])
        vocab, uni = vocab_cache[key]
        at_budget = float(np.interp(budget_s * s["tokens_per_sec"], r["tokens"], r["losses"]))
        lines.append(f"| {v} | {vocab:,} | {uni:.2f} | {s['tokens_per_sec']:,.0f} | {s['eval_loss']:.3f} | "
                     f"{100 * s['eval_mlm_accuracy']:.1f}% | {uni - s['eval_loss']:.2f} | {at_budget:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--only", default="", help="comma list of variants (default: all)")
    parser.add_argument("--report", action="store_true", help="only write the table")
    args = parser.parse_args()
    variants = [v for v in args.only.split(",") if v] or list(VARIANTS)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for v in variants:
            run_variant(v, args.workdir / v)
    table = report(args.workdir, variants)
    (args.workdir / "recipe.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
