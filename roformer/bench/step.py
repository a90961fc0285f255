"""Train-step time, tokens/s and MFU per model size, sequence length and position scheme.

Each (size, sequence length) group builds one train workload per scheme and times
them in alternating rounds together with a square matmul, so every round has its
own matmul-peak measurement: MFU = analytic FLOPs per step / step time / that peak
(the median over rounds is reported; `mfu_best_peak` divides the median step by the
best matmul rate of any round instead, the conservative figure the target is judged
on). On an accelerator with a known peak (roformer.train.flops.PEAK_FLOPS) that
vendor peak is used instead and the measured matmul rate is reported beside it. Ratios to learned absolute positions are medians of
per-round ratios with their min and max.
"""
from __future__ import annotations

import argparse
import gc
import statistics

import jax

from roformer.attention import ATTENTION_IMPLEMENTATIONS
from roformer.bench.common import alternate, matmul_probe, ratio_stats
from roformer.bench.workload import build_train_workload
from roformer.model import PRESETS, ModelConfig
from roformer.positions import POSITION_SCHEMES
from roformer.train import flops as train_flops

BASELINE = "learned"
# Targets from the performance issue: (scheme, seq_len) -> max ratio to learned absolute.
RATIO_TARGETS = {("rope", 512): 1.05, ("shaw", 512): 1.3, ("t5", 512): 1.3}
MFU_TARGET = {"cpu": 0.5, "gpu": 0.4}  # base size: f32 on CPU, bf16 on an accelerator
TABLE_COLUMNS = ("size", "seq", "scheme", "batch", "params_M", "ms_step", "tokens_s", "GFLOP_s",
                 "peak_GFLOP_s", "mfu", "mfu_best_peak", "x_learned", "x_learned_min", "x_learned_max")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", nargs="+", default=["tiny", "mini", "small", "base"], choices=list(PRESETS))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--schemes", nargs="+", default=list(POSITION_SCHEMES), choices=sorted(POSITION_SCHEMES))
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLEMENTATIONS,
                        help="jax.nn.dot_product_attention implementation (cudnn on GPU)")
    parser.add_argument("--attention-dropout", type=float, default=None,
                        help="override attention dropout (0 lets softmax attention use the fused kernel "
                             "in training; default: the model config's 0.1)")
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--peak-size", type=int, default=0,
                        help="side of the square matmul probing the peak (0: 2048 on CPU, 8192 otherwise)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--iters", type=int, default=2, help="steps per scheme per round (median taken)")


def model_config(size: str, scheme: str, args: argparse.Namespace, max_len: int) -> ModelConfig:
    overrides = dict(position=scheme, dtype=args.dtype, vocab_size=args.vocab_size,
                     max_position_embeddings=max(512, max_len))
    if args.attention_dropout is not None:
        overrides["attention_dropout"] = args.attention_dropout
    return ModelConfig.from_preset(size, **overrides)


def vendor_peak(dtype: str) -> float | None:
    """The table peak of an accelerator, None on CPU or an unknown device."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    for name, peaks in train_flops.PEAK_FLOPS:
        if name.lower() in device.device_kind.lower():
            return peaks[0 if dtype == "bfloat16" else 1]
    return None


def bench_group(size: str, seq_len: int, batch: int, schemes, args: argparse.Namespace,
                max_len: int | None = None) -> list[dict]:
    """Time every scheme at one (size, seq_len) in alternating rounds with a matmul; one row
    per scheme. `max_len` sizes the learned position table (scaling needs the longest)."""
    workloads = {
        scheme: build_train_workload(model_config(size, scheme, args, max_len or seq_len),
                                     batch_size=batch, seq_len=seq_len,
                                     attention_impl=args.attention_impl)
        for scheme in schemes}
    peak_size = args.peak_size or (2048 if jax.devices()[0].platform == "cpu" else 8192)
    variants = {scheme: w.step for scheme, w in workloads.items()}
    variants["matmul"], matmul_flops = matmul_probe(peak_size, args.dtype)
    times = alternate(variants, rounds=args.rounds, iters=args.iters, warmup=1)
    measured_peaks = [matmul_flops / t for t in times.pop("matmul")]
    table_peak = vendor_peak(args.dtype)
    rows = []
    for scheme, workload in workloads.items():
        seconds = times[scheme]
        peaks = [table_peak] * len(seconds) if table_peak else measured_peaks
        mfus = [workload.flops_per_step / t / p for t, p in zip(seconds, peaks)]
        step_s = statistics.median(seconds)
        row = {"size": size, "seq": seq_len, "scheme": scheme, "batch": batch,
               "params_M": workload.num_params / 1e6, "ms_step": step_s * 1e3,
               "tokens_s": workload.tokens_per_step / step_s,
               "GFLOP_step": workload.flops_per_step / 1e9,
               "GFLOP_s": workload.flops_per_step / step_s / 1e9,
               "peak_GFLOP_s": statistics.median(peaks) / 1e9,
               "matmul_GFLOP_s": statistics.median(measured_peaks) / 1e9,
               "mfu": statistics.median(mfus), "mfu_min": min(mfus), "mfu_max": max(mfus),
               # conservative: the median step against the best matmul rate seen in any round
               "mfu_best_peak": workload.flops_per_step / step_s / max(peaks)}
        if BASELINE in times:
            stats = ratio_stats(seconds, times[BASELINE])
            row.update(x_learned=stats["median"], x_learned_min=stats["min"], x_learned_max=stats["max"])
        rows.append(row)
    del workloads, variants  # free this group's model and optimizer states before the next
    gc.collect()
    return rows


def targets(rows: list[dict], rounds: int) -> list[dict]:
    """The issue's step targets that these rows can speak to."""
    out = []
    for row in rows:
        target = RATIO_TARGETS.get((row["scheme"], row["seq"]))
        if target is not None and "x_learned" in row:
            out.append({"name": f"{row['scheme']} / learned step time [{row['size']} seq {row['seq']}]",
                        "median": row["x_learned"], "min": row["x_learned_min"], "max": row["x_learned_max"],
                        "rounds": rounds, "target": f"<= {target}", "met": row["x_learned"] <= target})
        if row["size"] == "base" and row["seq"] == 128 and row["scheme"] == "rope":
            platform = "cpu" if jax.devices()[0].platform == "cpu" else "gpu"
            goal = MFU_TARGET[platform]
            out.append({"name": f"MFU base seq 128 {row['scheme']} ({platform}; per-round peak, "
                                f"vs best peak {row['mfu_best_peak']:.3f})", "median": row["mfu"],
                        "min": row["mfu_min"], "max": row["mfu_max"], "rounds": rounds,
                        "target": f">= {goal} (vs best peak)", "met": row["mfu_best_peak"] >= goal})
    return out


def run(args: argparse.Namespace) -> dict:
    rows = []
    for size in args.sizes:
        for seq_len in args.seq_lens:
            group_rows = bench_group(size, seq_len, args.batch, args.schemes, args)
            rows += group_rows
    return {"rows": rows, "comparisons": targets(rows, args.rounds), "columns": TABLE_COLUMNS,
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}
