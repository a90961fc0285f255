"""Train-step time, tokens/s and MFU per model size, sequence length and position scheme.

Each (size, sequence length) group builds one train workload per scheme and times
them in alternating rounds together with a square matmul, so every round has its
own matmul-peak measurement: MFU = analytic FLOPs per step / step time / that peak
(the median over rounds is reported; `mfu_best_peak` divides the median step by the
best matmul rate of any round instead, the conservative figure). On an accelerator
with a known peak (roformer.train.flops.PEAK_FLOPS) that vendor peak is used instead
and the measured matmul rate is reported beside it. Ratios to learned absolute
positions (and, with several --dropout-rng-impls or --hidden-dropouts, to the first of
them) are medians of per-round ratios with their min and max.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

import jax

from roformer import cli
from roformer.model.attention import ATTENTION_IMPLEMENTATIONS
from roformer.bench.common import TRAIN_STEP_WARMUP, alternate, ratio_stats
from roformer.bench.workload import TrainWorkload, build_train_workload
from roformer.machine import matmul_probe
from roformer.model import PRESETS, ModelConfig
from roformer.model.positions import POSITION_SCHEMES
from roformer.train import flops as train_flops
from roformer.train.steps import DROPOUT_RNG_IMPLS

BASELINE = "learned"
TABLE_COLUMNS = ("size", "seq", "scheme", "dropout_rng", "hidden_dropout", "batch", "params_M", "ms_step", "tokens_s",
                 "GFLOP_s", "peak_GFLOP_s", "mfu", "mfu_best_peak", "x_learned", "x_learned_min",
                 "x_learned_max", "x_dropout_ref", "x_hidden_ref")


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--sizes", many=True, default=["tiny", "mini", "small", "base"], choices=list(PRESETS))
    command.define("--seq-lens", type=int, many=True, default=[128, 512])
    command.define("--schemes", many=True, default=list(POSITION_SCHEMES), choices=sorted(POSITION_SCHEMES))
    command.define("--batch", type=int, default=8, help="sequences per step")
    command.define("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    command.define("--attention-impl", default="auto", choices=ATTENTION_IMPLEMENTATIONS,
                   help="jax.nn.dot_product_attention implementation (cudnn on GPU)")
    command.define("--attention-dropout", type=float, default=None,
                   help="override attention dropout (0 lets softmax attention use the fused kernel "
                        "in training; default: the model config's 0.1)")
    command.define("--dropout-rng-impls", many=True, default=["threefry2x32"], choices=DROPOUT_RNG_IMPLS,
                   help="dropout key implementations (train.dropout_rng_impl) to time side by side; "
                        "x_dropout_ref is each one's step time over the first's")
    command.define("--hidden-dropouts", type=float, many=True, default=[None],
                   help="hidden dropout rates to time side by side (default: the model config's); "
                        "x_hidden_ref is each one's step time over the first's, e.g. 0.1,0 for "
                        "what the dropout masks cost")
    command.define("--vocab-size", type=int, default=30522)
    command.define("--peak-size", type=int, default=0,
                   help="side of the square matmul probing the peak (0: 2048 on CPU, 8192 otherwise)")
    command.define("--rounds", type=int, default=3, help="alternating rounds")
    command.define("--iters", type=int, default=2, help="steps per scheme per round (median taken)")


def model_config(size: str, scheme: str, args: SimpleNamespace, max_len: int,
                 hidden_dropout: float | None = None) -> ModelConfig:
    overrides = dict(position=scheme, dtype=args.dtype, vocab_size=args.vocab_size,
                     max_position_embeddings=max(512, max_len))
    if args.attention_dropout is not None:
        overrides["attention_dropout"] = args.attention_dropout
    if hidden_dropout is not None:
        overrides["hidden_dropout"] = hidden_dropout
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


def default_peak_size() -> int:
    return 2048 if jax.devices()[0].platform == "cpu" else 8192


def time_with_matmul(steps: dict[str, Callable], *, dtype: str, peak_size: int, rounds: int, iters: int,
                     warmup: int = TRAIN_STEP_WARMUP) -> tuple[dict[str, list[float]], list[float]]:
    """Alternating rounds of the given steps and a square matmul of `dtype`: per-round
    seconds of each step, and the matmul's FLOP/s in each round (the MFU denominator on
    devices without a vendor peak, measured under the same load)."""
    variants = dict(steps)
    variants["matmul"], matmul_flops = matmul_probe(peak_size, dtype)
    times = alternate(variants, rounds=rounds, iters=iters, warmup=warmup)
    return times, [matmul_flops / t for t in times.pop("matmul")]


def step_figures(workload: TrainWorkload, seconds: list[float], measured_peaks: list[float],
                 table_peak: float | None) -> dict:
    """ms/step, tokens/s, achieved GFLOP/s and MFU (median, min, max over rounds; and the
    median step against the best peak of any round) of one workload's per-round times. MFU
    divides by the accelerator's `table_peak` (`vendor_peak`) in every round, or, where there
    is none (a CPU), by the matmul rate measured in the same round."""
    peaks = [table_peak] * len(seconds) if table_peak else measured_peaks
    mfus = [workload.flops_per_step / t / p for t, p in zip(seconds, peaks)]
    step_s = statistics.median(seconds)
    return {"params_M": workload.num_params / 1e6, "ms_step": step_s * 1e3,
            "tokens_s": workload.tokens_per_step / step_s,
            "GFLOP_step": workload.flops_per_step / 1e9,
            "GFLOP_s": workload.flops_per_step / step_s / 1e9,
            "peak_GFLOP_s": statistics.median(peaks) / 1e9,
            "matmul_GFLOP_s": statistics.median(measured_peaks) / 1e9,
            "mfu": statistics.median(mfus), "mfu_min": min(mfus), "mfu_max": max(mfus),
            "mfu_best_peak": workload.flops_per_step / step_s / max(peaks)}


def bench_group(size: str, seq_len: int, batch: int, schemes, args: SimpleNamespace,
                max_len: int | None = None, dropout_rng_impls=("threefry2x32",),
                hidden_dropouts=(None,)) -> list[dict]:
    """Time every (scheme, dropout key implementation, hidden dropout) at one (size, seq_len)
    in alternating rounds with a matmul; one row each. `max_len` sizes the learned position
    table (scaling needs the longest); a hidden dropout of None is the model config's."""
    workloads = {}
    for scheme in schemes:
        for impl in dropout_rng_impls:
            for rate in hidden_dropouts:
                # each build compiles a train step (seconds to minutes): a line per build, so a
                # long benchmark shows where it is
                print(f"step {size}/{seq_len}/{batch} {scheme}: compiling ...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                workloads[(scheme, impl, rate)] = build_train_workload(
                    model_config(size, scheme, args, max_len or seq_len, hidden_dropout=rate),
                    batch_size=batch, seq_len=seq_len, attention_impl=args.attention_impl, dropout_rng_impl=impl)
                print(f"step {size}/{seq_len}/{batch} {scheme}: compiled in {time.perf_counter() - started:.1f}s",
                      file=sys.stderr, flush=True)
    print(f"step {size}/{seq_len}/{batch}: timing {len(workloads)} variant(s), {args.rounds} rounds",
          file=sys.stderr, flush=True)
    labels = {key: "/".join(map(str, key)) for key in workloads}
    # The first step's loss, from the seed's initial parameters and batch: the same in every
    # process unless a setting changes the arithmetic (roformer.bench.flags compares it).
    first_losses = {key: float(w.step()[1]["loss"]) for key, w in workloads.items()}
    times, measured_peaks = time_with_matmul(
        {labels[key]: w.step for key, w in workloads.items()}, dtype=args.dtype,
        peak_size=args.peak_size or default_peak_size(), rounds=args.rounds, iters=args.iters)
    table_peak = vendor_peak(args.dtype)
    reference_impl, reference_rate = dropout_rng_impls[0], hidden_dropouts[0]
    rows = []
    for (scheme, impl, rate), workload in workloads.items():
        seconds = times[labels[scheme, impl, rate]]
        row = {"size": size, "seq": seq_len, "scheme": scheme, "dropout_rng": impl,
               "hidden_dropout": workload.config.hidden_dropout, "batch": batch,
               **step_figures(workload, seconds, measured_peaks, table_peak),
               "loss_step1": first_losses[scheme, impl, rate]}
        for name, reference, variants in (("x_learned", (BASELINE, impl, rate), True),
                                          ("x_dropout_ref", (scheme, reference_impl, rate), len(dropout_rng_impls) > 1),
                                          ("x_hidden_ref", (scheme, impl, reference_rate), len(hidden_dropouts) > 1)):
            if variants and reference in workloads:
                stats = ratio_stats(seconds, times[labels[reference]])
                row.update({name: stats["median"], f"{name}_min": stats["min"], f"{name}_max": stats["max"]})
        rows.append(row)
    del workloads  # free this group's model and optimizer states before the next
    gc.collect()
    return rows


def run(args: SimpleNamespace) -> dict:
    rows = []
    for size in args.sizes:
        for seq_len in args.seq_lens:
            rows += bench_group(size, seq_len, args.batch, args.schemes, args,
                                dropout_rng_impls=tuple(args.dropout_rng_impls),
                                hidden_dropouts=tuple(args.hidden_dropouts))
    return {"rows": rows, "columns": TABLE_COLUMNS,
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}
