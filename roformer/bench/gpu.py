"""gpu: one command for an accelerator host (GPU or TPU), in under 10 minutes.

  train step  bf16 compute, tokens/s and MFU against the device's dense bf16 peak
              (roformer.train.flops.PEAK_FLOPS; on a device not in that table, against
              the bf16 matmul rate measured in the same rounds, with a note) for every
              --sizes (tiny..base) at every --seq-lens (128, 512), --tokens per step.
              Variants per (size, seq): learned and rope positions with fused attention
              (jax.nn.dot_product_attention's cuDNN kernel, GPU only), and rope with XLA
              attention (fused off). Attention dropout is 0 in all of them (the fused
              kernel has none; hidden dropout stays 0.1), so on and off differ only in the
              kernel. Each group runs in alternating rounds with a bf16 matmul; ratios are
              to learned (x_learned) and to the fused rope step (x_fused).
  rope        roformer.model.rope.apply_rope against a scale-copy and the real forms (the `rope`
              benchmark's variants) at --rope-lengths, batch 8, f32 and bf16, forward
              and forward+backward.
Groups run largest first, so that --budget-s (your time limit, default 540 s), which starts
no group that the previous one's duration says would end past it, cuts the small sizes
rather than base. A run keeps what it has: a group whose fused
kernel fails is timed again with XLA attention alone, any other failure (of a group or a
RoPE shape) is a note and the run goes on, and with --json the result so far is written
after every group (marked "partial" until the run ends), so a run stopped from outside
still leaves its figures.
Needs only jax, flax, optax, orbax and numpy besides the project. On a CPU it refuses to
run (exit 2); --cpu-dry-run runs the same path there, for tests at tiny size.
"""
from __future__ import annotations

import gc
import importlib.metadata
import sys
import time
from types import SimpleNamespace

import jax

from roformer import cli
from roformer.bench import rope as rope_bench
from roformer.bench.common import failure, ratio_stats, write_json
from roformer.bench.step import default_peak_size, step_figures, time_with_matmul, vendor_peak
from roformer.bench.workload import build_train_workload
from roformer.machine import machine_info
from roformer.model import PRESETS, ModelConfig

DTYPE = "bfloat16"
TABLE_COLUMNS = ("size", "seq", "variant", "batch", "ms_step", "tokens_s", "GFLOP_s", "peak_GFLOP_s", "mfu",
                 "x_learned", "x_fused")
ROPE_COLUMNS = ("shape", "dtype", "pass", "variant", "ms", "GB/s", "x_copy", "x_real")
VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--sizes", many=True, default=["tiny", "mini", "small", "medium", "base"],
                   choices=list(PRESETS))
    command.define("--seq-lens", type=int, many=True, default=[128, 512])
    command.define("--tokens", type=int, default=32768, help="tokens per step (batch = tokens / seq)")
    command.define("--vocab-size", type=int, default=30522)
    command.define("--rope-lengths", type=int, many=True, default=[512, 4096])
    command.define("--rope-batch", type=int, default=8)
    command.define("--peak-size", type=int, default=0, help="bf16 matmul side (0: 8192)")
    command.define("--rounds", type=int, default=3)
    command.define("--iters", type=int, default=10, help="steps per variant per round (median taken)")
    command.define("--budget-s", type=float, default=540.0,
                   help="start no group that would end (by the previous group's time) past this")
    command.define("--cpu-dry-run", type=bool,
                   help="run on a CPU anyway (for tests, at tiny sizes; the figures mean nothing)")


def attention_kernels(platform: str) -> tuple[list[str], list[str]]:
    """The attention implementations to time on this platform (fused first), and notes."""
    if platform == "gpu":
        return ["cudnn", "xla"], []
    return ["xla"], [f"fused attention (cuDNN) is GPU-only: on {platform} only XLA attention is timed"]


def train_group(size: str, seq_len: int, kernels: list[str], args: SimpleNamespace,
                table_peak: float | None) -> list[dict]:
    """learned and rope on the first (fused) kernel, rope on the others; alternating rounds."""
    batch = max(args.tokens // seq_len, 1)
    variants = [("learned", kernels[0])] + [("rope", kernel) for kernel in kernels]
    workloads = {}
    for scheme, kernel in variants:
        config = ModelConfig.from_preset(size, position=scheme, dtype=DTYPE, vocab_size=args.vocab_size,
                                         max_position_embeddings=max(512, seq_len), attention_dropout=0.0)
        workloads[f"{scheme}/{kernel}"] = build_train_workload(config, batch_size=batch, seq_len=seq_len,
                                                               attention_impl=kernel)
    times, measured_peaks = time_with_matmul({name: w.step for name, w in workloads.items()}, dtype=DTYPE,
                                             peak_size=args.peak_size or default_peak_size(),
                                             rounds=args.rounds, iters=args.iters)
    learned, fused_rope = f"learned/{kernels[0]}", f"rope/{kernels[0]}"
    rows = []
    for name, workload in workloads.items():
        seconds = times[name]
        row = {"size": size, "seq": seq_len, "variant": name, "batch": batch,
               **step_figures(workload, seconds, measured_peaks, table_peak)}
        for column, reference in (("x_learned", learned), ("x_fused", fused_rope)):
            stats = ratio_stats(seconds, times[reference])
            row.update({column: stats["median"], f"{column}_min": stats["min"], f"{column}_max": stats["max"]})
        rows.append(row)
    del workloads
    gc.collect()
    return rows


def versions() -> dict:
    """Installed versions of the packages that decide the figures. Distributions come in
    sys.path order, so where a package is installed twice (one carried onto PYTHONPATH over
    an image's own) the first one is the one `import` takes."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name in VERSIONED or name.startswith(("jax-cuda", "jax_cuda", "nvidia-cudnn", "libtpu")):
            found.setdefault(name, dist.version)
    return dict(sorted(found.items()))


def run(args: SimpleNamespace) -> dict:
    platform = jax.default_backend()
    if platform == "cpu" and not args.cpu_dry_run:
        print("roformer.bench gpu: no GPU or TPU found (jax backend: cpu); run it on an accelerator host",
              file=sys.stderr)
        raise SystemExit(2)
    start = time.perf_counter()
    kernels, notes = attention_kernels(platform)
    if platform == "cpu":
        notes.append("CPU dry run: the figures mean nothing")
    table_peak = vendor_peak(DTYPE)
    if table_peak is None:
        notes.append(f"{jax.devices()[0].device_kind} has no bf16 peak in roformer.train.flops.PEAK_FLOPS: "
                     "MFU is against the bf16 matmul rate measured in the same rounds")

    rope_rows, rows = [], []
    fixed = {"columns": TABLE_COLUMNS, "peak_flops": table_peak, "versions": versions(),
             "device_kinds": sorted({d.device_kind for d in jax.devices()}),
             "settings": {k: v for k, v in vars(args).items() if k != "json"}}

    def result(partial: bool) -> dict:
        return {"rows": sorted(rows, key=lambda r: (list(PRESETS).index(r["size"]), r["seq"])),
                "tables": {"RoPE kernel vs copy": {"rows": rope_rows, "columns": ROPE_COLUMNS}},
                "notes": list(notes), "wall_s": round(time.perf_counter() - start, 1), "partial": partial,
                **fixed}

    for dtype in ("float32", "bfloat16"):
        for length in args.rope_lengths:
            for backward in (False, True):
                try:
                    rope_rows += rope_bench.bench_shape(args.rope_batch, length, 12, 64, dtype, backward=backward,
                                                        rounds=args.rounds, iters=args.iters)
                except Exception as error:   # noqa: BLE001 (the train step groups still run)
                    notes.append(f"RoPE {dtype} {args.rope_batch}x{length} {'fwd+bwd' if backward else 'fwd'} "
                                 f"failed ({failure(error)})")
    write_partial(args, result(partial=True))

    skipped, last_group_s = [], 0.0
    order = sorted(args.sizes, key=list(PRESETS).index, reverse=True)   # largest first
    for size in order:
        for seq_len in sorted(args.seq_lens, reverse=True):
            # groups shrink as the run goes on, so the last one bounds the next one's time
            if time.perf_counter() - start + last_group_s > args.budget_s:
                skipped.append(f"{size}/{seq_len}")
                continue
            group_start = time.perf_counter()
            rows += timed_group(size, seq_len, kernels, args, table_peak, notes)
            last_group_s = time.perf_counter() - group_start
            print(f"gpu {size}/{seq_len}: {last_group_s:.0f} s", file=sys.stderr, flush=True)
            write_partial(args, result(partial=True))
    if skipped:
        notes.append(f"not measured, over the {args.budget_s:.0f} s budget: {', '.join(skipped)}")
    return result(partial=False)


def timed_group(size: str, seq_len: int, kernels: list[str], args: SimpleNamespace,
                table_peak: float | None, notes: list[str]) -> list[dict]:
    """train_group, falling back to XLA attention alone when a group with the fused kernel
    fails, and to a note when that fails too."""
    tried = [kernels] + ([["xla"]] if kernels != ["xla"] else [])
    for attempt in tried:
        try:
            return train_group(size, seq_len, attempt, args, table_peak)
        except Exception as error:   # noqa: BLE001 (any failure of one group must not end the run)
            retry = "; timed again with XLA attention alone" if attempt != tried[-1] else ""
            notes.append(f"{size}/{seq_len} with {'+'.join(attempt)} attention failed ({failure(error)}){retry}")
        gc.collect()   # the failed group's buffers, now that its traceback is gone
    return []


def write_partial(args: SimpleNamespace, result: dict) -> None:
    """The result so far, where --json will put the whole one."""
    if args.json is not None:
        write_json(args.json, {"benchmark": "gpu", "machine": machine_info(), **result})
