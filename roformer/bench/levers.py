"""levers: the train step's speed levers, each alone and all together, against the step
without them, in alternating rounds in one process.

Per shape (size/seq_len/batch), each variant builds its own train workload (rope, bf16
compute by default, attention dropout 0 so that the fused kernel runs, hidden dropout 0.1:
the step `python -m roformer.pretrain` runs) and compiles it under its own backend forms
(roformer.model.backend.using_forms: the choice is made while the step is traced), then all
of them and a square matmul run in alternating rounds, so that every round compares the
variants under the same load:

  baseline          no backend form, threefry2x32 dropout keys, the shape's batch; rows of
                    one whole document each, so attention gets no mask
  segment_mask      the baseline with the packed rows' [B, 1, L, L] segment mask (one segment
                    per row: the same attention): what cuDNN got before padding reached it in
                    the form it takes, and what packed pretraining batches still give it
  all               every XLA form below and rbg dropout keys (not the Pallas kernel,
                    which may fail to lower where XLA's forms do not: it is timed alone,
                    and joins `adopted` when it pays)
  rope_half_pairs   RoPE's pairs as split halves (q/k kernel columns permuted per head)
  fused_qkv         q, k and v from one product
  bf16_mlm_logits   bf16 MLM logits, the loss's log-sum-exp in float32
  pallas_residual_norm
                    dropout + residual add + LayerNorm (post-LN) as one Pallas kernel each
                    way (Triton; in interpret mode on a CPU, which is slow)
  rbg_dropout       dropout keys of jax's rbg implementation (XLA's RngBitGenerator)
  all_batch_x2      `all` at twice the shape's batch
  fused_mlm_loss    the MLM loss with its own backward (no float32 copy of the logits, no scatter)
  gpu_default       the GPU's default forms (backend.DEFAULT_FORMS["gpu"]): what `accel=gpu` runs,
                    against the baseline's none (scripts/bench_accelerator.sh's `confirm` step)

Then the levers that paid alone at the first shape (median `x_tokens` at least
`--adopt-above`, every round above 1, the first step's loss within bf16 rounding of the
baseline's except where the masks differ by design, and a program other than the baseline's)
are built together as `adopted` and timed against the baseline once more, in rounds of their
own (rows of stage `adopted`): picked as the best of several, the lever rows' ratios lean
high, so the set is adopted only when it pays there too, and keeps the baseline's first step
(`not_confirmed`). The other shapes time the baseline
and `adopted` (`--other-variants`): the MFU before and after at each shape, in one process.

`x_tokens` is a variant's tokens/s over the baseline's (median of the per-round ratios, with
their min and max): above 1 is faster. `loss_step1` is the first step's loss from the same
initial parameters and batch, `dgrad_step1` its gradient norm over the baseline's, less 1:
forms that leave the arithmetic alone match the baseline's to bf16 rounding (the loss is taken
before the update, so only the gradient norm sees a wrong backward); rbg dropout draws other
masks and twice the batch is another batch, so theirs differ by design. XLA flags
(`XLA_FLAGS`) are read once per process: the row says which were set, and
scripts/bench_accelerator.sh's `ab` step runs this benchmark once per flag set.

With `--adopted-from` a finished run's JSON, the levers are not measured again: its adopted
variant is timed against the baseline at every shape given (the shapes a time limit left for a
later run).

Accelerator time is scarce, so a variant that fails to build or to run its first step (a
kernel that does not lower, say) is a row whose `failed` column says why, and the rest
still run; `--budget-s` starts no build that the builds so far say would
end past it (shapes are measured in the order given; at the first shape a lever is built
only while one more build would still fit, for the adopted levers' confirmation); with --json
the result so far is written after every shape.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import sys
import time
from types import SimpleNamespace

import jax

from roformer import cli
from roformer.bench.common import failure, ratio_stats, write_json
from roformer.bench.step import default_peak_size, step_figures, time_with_matmul, vendor_peak
from roformer.bench.workload import build_train_workload
from roformer.model import PRESETS, ModelConfig, backend


@dataclasses.dataclass(frozen=True)
class Variant:
    forms: tuple[str, ...] = ()
    dropout_rng_impl: str = "threefry2x32"
    batch_factor: int = 1
    segment_mask: bool = False


ALL_FORMS = tuple(form for form in backend.FORMS if form not in backend.KERNEL_FORMS)
# In the order they are built, so that a budget cut leaves the levers alone last.
VARIANTS = {
    "baseline": Variant(),
    "segment_mask": Variant(segment_mask=True),
    "all": Variant(forms=ALL_FORMS, dropout_rng_impl="rbg"),
    "rope_half_pairs": Variant(forms=("rope_half_pairs",)),
    "fused_qkv": Variant(forms=("fused_qkv",)),
    "bf16_mlm_logits": Variant(forms=("bf16_mlm_logits",)),
    "pallas_residual_norm": Variant(forms=("pallas_residual_norm",)),
    "rbg_dropout": Variant(dropout_rng_impl="rbg"),
    "all_batch_x2": Variant(forms=ALL_FORMS, dropout_rng_impl="rbg", batch_factor=2),
    "fused_mlm_loss": Variant(forms=("fused_mlm_loss",)),
    "gpu_default": Variant(forms=tuple(sorted(backend.DEFAULT_FORMS["gpu"]))),
}
BASELINE = "baseline"
ADOPTED = "adopted"   # the levers that paid alone at the first shape, together (adopted_variant)
LEVERS = ("rope_half_pairs", "fused_qkv", "bf16_mlm_logits", "pallas_residual_norm",
          "rbg_dropout", "fused_mlm_loss")
TABLE_COLUMNS = ("stage", "size", "seq", "batch", "variant", "xla_flags", "ms_step", "tokens_s", "mfu", "x_tokens",
                 "x_tokens_min", "x_tokens_max", "loss_step1", "dloss_step1", "dgrad_step1", "program", "failed")


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--shapes", many=True, default=["base/512/64", "base/128/256", "small/512/64"],
                   help="size/seq_len/batch, measured in this order")
    command.define("--variants", many=True, default=list(VARIANTS), choices=list(VARIANTS),
                   help="variants of the first shape (baseline is always measured)")
    command.define("--other-variants", many=True, default=[BASELINE, ADOPTED],
                   choices=[*VARIANTS, ADOPTED],
                   help="variants of the other shapes; `adopted` is the levers that paid alone at the "
                        "first shape, together (timed there too, against the baseline, after the "
                        "levers), left out when none did")
    command.define("--adopt-above", type=float, default=1.005,
                   help="a lever is adopted when its median x_tokens is at least this and every "
                        "round's is above 1")
    command.define("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    command.define("--attention-impl", default=None, choices=["auto", "xla", "cudnn"],
                   help="default: cudnn on a GPU, auto elsewhere")
    command.define("--vocab-size", type=int, default=30522)
    command.define("--peak-size", type=int, default=0, help="side of the matmul probe (0: the platform's)")
    command.define("--rounds", type=int, default=3)
    command.define("--iters", type=int, default=5, help="steps per variant per round (median taken)")
    command.define("--budget-s", type=float, default=0.0, help="start no build past this (0: no limit)")
    command.define("--adopted-from", default=None, metavar="JSON",
                   help="a finished run's result: its adopted levers are timed against the baseline at "
                        "every shape, without measuring each lever again (the shapes its budget left)")


def parse_shape(text: str) -> tuple[str, int, int]:
    size, seq_len, batch = text.split("/")
    if size not in PRESETS:
        raise SystemExit(f"unknown size {size!r} in shape {text!r}; choose one of {list(PRESETS)}")
    return size, int(seq_len), int(batch)


def build(size: str, seq_len: int, batch: int, variant: Variant, args: SimpleNamespace):
    """The variant's workload, compiled under its forms, and its first step's loss and gradient
    norm ({"loss", "grad_norm"})."""
    config = ModelConfig.from_preset(size, position="rope", dtype=args.dtype, vocab_size=args.vocab_size,
                                     max_position_embeddings=max(512, seq_len), attention_dropout=0.0)
    with backend.using_forms(variant.forms):
        workload = build_train_workload(config, batch_size=batch * variant.batch_factor, seq_len=seq_len,
                                        attention_impl=args.attention_impl,
                                        dropout_rng_impl=variant.dropout_rng_impl,
                                        segment_mask=variant.segment_mask)
    metrics = workload.step()[1]
    return workload, {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


def program_digest(workload) -> str:
    """A short digest of the compiled step's instructions, without its debug information
    (metadata, the Python stack frames it was traced from): variants whose forms change the
    program differ in it, a form that silently changed nothing would not."""
    lines = [re.sub(r",? ?stack_frame_id=\d+", "", re.sub(r", metadata=\{[^}]*\}", "", line))
             for line in workload.step_fn.as_text().splitlines()
             if re.match(r"\s*(%|ROOT|ENTRY|fused_computation|\})", line)]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


class Budget:
    """Whether one more build fits before `limit_s` (0: always), judged by the longest so far."""

    def __init__(self, limit_s: float):
        self.start, self.limit_s, self.longest = time.perf_counter(), limit_s, 0.0

    def allows_build(self, reserve: int = 0) -> bool:
        """`reserve`: builds that must still fit after this one."""
        return (not self.limit_s
                or time.perf_counter() - self.start + 1.2 * self.longest * (1 + reserve) <= self.limit_s)

    def built(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


class Group:
    """One shape's workloads, built one by one under the budget, then timed together."""

    def __init__(self, shape: str, args: SimpleNamespace, budget: Budget, notes: list[str]):
        self.shape, self.args, self.budget, self.notes = shape, args, budget, notes
        self.size, self.seq_len, self.batch = parse_shape(shape)
        self.built, self.variants, self.first, self.failed = {}, {}, {}, {}

    def build(self, name: str, variant: Variant, reserve: int = 0) -> bool:
        if not self.budget.allows_build(reserve):
            kept = " with a build kept for the adopted levers' confirmation" if reserve else ""
            self.notes.append(f"{self.shape} {name}: not built, past the {self.args.budget_s:g} s budget{kept}")
            return False
        started = time.perf_counter()
        try:
            self.built[name], self.first[name] = build(self.size, self.seq_len, self.batch, variant, self.args)
        except Exception as error:   # noqa: BLE001 (one variant's failure must not end the run)
            self.notes.append(f"{self.shape} {name}: failed ({failure(error)})")
            self.failed[name] = (variant, failure(error))
            gc.collect()
            return False
        self.variants[name] = variant
        self.budget.built(time.perf_counter() - started)
        print(f"levers {self.shape} {name}: built in {time.perf_counter() - started:.0f} s, "
              f"first loss {self.first[name]['loss']:.6f}", file=sys.stderr, flush=True)
        return True

    def drop(self, keep: set[str]) -> None:
        for name in set(self.built) - keep:
            del self.built[name]
        gc.collect()

    def failed_rows(self, stage: str) -> list[dict]:
        """A row for each variant whose build failed since the last call: its name and why."""
        rows = [{"stage": stage, "size": self.size, "seq": self.seq_len, "batch": self.batch * variant.batch_factor,
                 "variant": name, "forms": list(variant.forms), "dropout_rng": variant.dropout_rng_impl,
                 "xla_flags": os.environ.get("XLA_FLAGS", "").strip(), "failed": why}
                for name, (variant, why) in self.failed.items()]
        self.failed.clear()
        return rows

    def time(self, stage: str) -> list[dict]:
        """Every built variant against the baseline in alternating rounds: one row each."""
        args, built = self.args, self.built
        times, measured_peaks = time_with_matmul({name: w.step for name, w in built.items()}, dtype=args.dtype,
                                                 peak_size=args.peak_size or default_peak_size(),
                                                 rounds=args.rounds, iters=args.iters)
        table_peak = vendor_peak(args.dtype)
        base = built[BASELINE]
        base_rates = [base.tokens_per_step / s for s in times[BASELINE]]
        rows = []
        for name, workload in built.items():
            seconds, variant = times[name], self.variants[name]
            stats = ratio_stats([workload.tokens_per_step / s for s in seconds], base_rates)
            rows.append({"stage": stage, "size": self.size, "seq": self.seq_len, "batch": workload.batch_size,
                         "variant": name, "forms": list(variant.forms), "dropout_rng": variant.dropout_rng_impl,
                         "xla_flags": os.environ.get("XLA_FLAGS", "").strip(),
                         **step_figures(workload, seconds, measured_peaks, table_peak),
                         "x_tokens": stats["median"], "x_tokens_min": stats["min"], "x_tokens_max": stats["max"],
                         **first_step_figures(self.first[name], self.first[BASELINE]),
                         "program": program_digest(workload),
                         "ms_step_rounds": [s * 1e3 for s in seconds]})
        return rows


# A lever that leaves the arithmetic alone gives the baseline's first-step loss to bf16
# rounding (a few 1e-5 here) and its gradient norm to a few 1e-3 relative; rbg keys draw other
# dropout masks, so theirs differ by design. The gradient norm catches a backward that is wrong
# where the forward is right (the loss is taken before the update).
LOSS_TOLERANCE = 2e-3
GRAD_NORM_TOLERANCE = 1e-2
OTHER_MASKS = ("rbg_dropout",)
BASELINE_KEYS = "threefry2x32"   # Variant()'s dropout keys: a row with others draws other masks


def first_step_figures(first: dict, base: dict) -> dict:
    """A variant's first-step loss, and its loss and gradient norm against the baseline's
    (`dgrad_step1` relative)."""
    return {"loss_step1": first["loss"], "dloss_step1": first["loss"] - base["loss"],
            "dgrad_step1": first["grad_norm"] / base["grad_norm"] - 1.0}


def first_step_off(row: dict) -> str | None:
    """Why a row's first step is not the baseline's arithmetic (non-finite, its loss or its
    gradient norm beyond rounding), or None. Rows written before the gradient norm was kept
    are read by their loss alone."""
    loss, dloss, dgrad = row.get("loss_step1"), row.get("dloss_step1", 0.0), row.get("dgrad_step1", 0.0)
    if loss is not None and not math.isfinite(loss):
        return f"first-step loss {loss}"
    if row["variant"] in OTHER_MASKS or row.get("dropout_rng", BASELINE_KEYS) != BASELINE_KEYS:
        return None
    if not abs(dloss) <= LOSS_TOLERANCE:   # written so that NaN (a baseline's) is off too
        return f"first-step loss {dloss:+.2g} off the baseline's"
    if not abs(dgrad) <= GRAD_NORM_TOLERANCE:
        return f"first-step gradient norm {dgrad:+.2g} (relative) off the baseline's"
    return None


def paid(row: dict, threshold: float) -> bool:
    """A timed row's tokens/s over the baseline's was at least `threshold` at the median and
    above 1 in every round."""
    return "x_tokens" in row and row["x_tokens"] >= threshold and row["x_tokens_min"] > 1.0


def lever_verdicts(rows: list[dict], threshold: float) -> dict[str, str]:
    """Each lever of `rows` (one shape's) -> "paid", or why it is not adopted: it failed to
    build, did not pay in every round, changed the first step's loss or gradient norm beyond
    bf16 rounding (`first_step_off`), or compiled to the baseline's own program (its form is not
    active here)."""
    rows = {row["variant"]: row for row in rows}
    base = rows.get(BASELINE, {})
    verdicts = {}
    for name in (name for name in LEVERS if name in rows):
        row = rows[name]
        if "x_tokens" not in row:
            verdicts[name] = f"failed ({row.get('failed', 'not timed')})"
        elif off := first_step_off(row):
            verdicts[name] = off
        elif row.get("program") is not None and row.get("program") == base.get("program"):
            verdicts[name] = "the baseline's own program"
        elif not paid(row, threshold):
            verdicts[name] = f"x_tokens {row['x_tokens']:.3f} (min {row['x_tokens_min']:.3f})"
        else:
            verdicts[name] = "paid"
    return verdicts


def not_confirmed(rows: list[dict], threshold: float) -> str | None:
    """Why the adopted levers are not adopted after their own rounds (`rows`' stage `adopted`,
    one shape's), or None when they paid there and kept the baseline's first step (its loss and
    gradient norm, to bf16 rounding; with rbg keys among them, only a finite first step):
    levers that are right alone can still be wrong together."""
    timed = [row for row in rows if row["stage"] == "adopted" and row["variant"] != BASELINE]
    if not timed or "x_tokens" not in timed[-1]:
        return "were not timed in rounds of their own: see the note above"
    if off := first_step_off(timed[-1]):
        return f"changed the first step ({off})"
    return None if paid(timed[-1], threshold) else "did not pay in their own rounds"


def confirmed(rows: list[dict], threshold: float) -> bool:
    return not_confirmed(rows, threshold) is None


def adopted_variant(rows: list[dict], threshold: float) -> tuple[Variant | None, list[str]]:
    """The levers that paid alone (`lever_verdicts`), together. Returns (the variant, or None
    when none paid; their names)."""
    paid_levers = [name for name, verdict in lever_verdicts(rows, threshold).items() if verdict == "paid"]
    if not paid_levers:
        return None, []
    forms = tuple(form for form in backend.FORMS if any(form in VARIANTS[name].forms for name in paid_levers))
    return (Variant(forms=forms, dropout_rng_impl="rbg" if "rbg_dropout" in paid_levers else "threefry2x32"),
            paid_levers)


def adopted_in_result(result: dict) -> Variant | None:
    """The adopted variant of a finished run's JSON (its first shape's lever rows and its
    --adopt-above, confirmed by the `adopted` stage's own rounds against the baseline; or the
    variant it took with --adopted-from), for a later process to run with the same levers (the
    A/B's peers stage, a later run's other shapes). None when no lever paid, or the levers
    together failed to build or did not pay in their own rounds."""
    if "adopted_from" in result:
        taken = result["adopted_from"]["variant"]
        return Variant(forms=tuple(taken["forms"]), dropout_rng_impl=taken["dropout_rng_impl"]) if taken else None
    shape = parse_shape(result["settings"]["shapes"][0])
    first = [row for row in result["rows"] if (row["size"], row["seq"]) == shape[:2]
             and row.get("batch", shape[2]) in (shape[2], shape[2] * VARIANTS.get(row["variant"], Variant()).batch_factor)]
    threshold = result["settings"]["adopt_above"]
    variant, _ = adopted_variant([row for row in first if row["stage"] == "levers"], threshold)
    return variant if variant is not None and confirmed(first, threshold) else None


def adopted_from_file(path: str) -> Variant | None:
    """The adopted variant of the levers result at `path`; a file that is not one is one line."""
    try:
        with open(path) as file:
            result = json.load(file)
        if result.get("benchmark") != "levers":
            raise ValueError(f"a {result.get('benchmark')!r} result, not a levers one")
        return adopted_in_result(result)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"--adopted-from {path}: cannot take its adopted levers ({failure(error)})") from None


def run(args: SimpleNamespace) -> dict:
    if args.attention_impl is None:
        args.attention_impl = "cudnn" if jax.default_backend() == "gpu" else "auto"
    continued = args.adopted_from is not None
    adopted = adopted_from_file(args.adopted_from) if continued else None
    budget, rows, notes = Budget(args.budget_s), [], []
    fixed = {"columns": TABLE_COLUMNS, "peak_flops": vendor_peak(args.dtype),
             "device_kinds": sorted({d.device_kind for d in jax.devices()}),
             "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    if continued:
        fixed["adopted_from"] = {"path": args.adopted_from,
                                 "variant": dataclasses.asdict(adopted) if adopted else None}
        notes.append(f"adopted (taken from {args.adopted_from}): "
                     + (f"forms {', '.join(adopted.forms) or 'none'}, {adopted.dropout_rng_impl} dropout keys"
                        if adopted else "none (no lever paid there): the baseline alone at each shape"))
    if fixed["peak_flops"] is None:
        notes.append(f"{jax.devices()[0].device_kind}: no vendor peak, so MFU is against the "
                     f"{args.dtype} matmul rate measured in the same rounds")

    def result(partial: bool) -> dict:
        return {"rows": rows, "notes": list(notes), "wall_s": round(time.perf_counter() - budget.start, 1),
                "partial": partial, **fixed}

    def done(shape: str) -> None:
        print(f"levers {shape}: done {time.perf_counter() - budget.start:.0f} s after the start",
              file=sys.stderr, flush=True)
        if args.json is not None:
            write_json(args.json, {"benchmark": "levers", **result(partial=True)})

    for index, shape in enumerate(args.shapes):
        group = Group(shape, args, budget, notes)
        if index == 0 and not continued:
            wanted = {name: VARIANTS[name] for name in VARIANTS if name == BASELINE or name in args.variants}
        else:
            wanted = {name: VARIANTS[name] if name != ADOPTED else adopted
                      for name in args.other_variants if name != ADOPTED or adopted is not None}
            wanted = {BASELINE: VARIANTS[BASELINE], **wanted}
        # The first shape keeps room to build the adopted levers for their confirmation: without
        # it a budget cut there leaves every lever measured and none adoptable.
        confirming = index == 0 and not continued and ADOPTED in args.other_variants
        for name, variant in wanted.items():
            if not group.build(name, variant, reserve=int(confirming and name != BASELINE)) and name == BASELINE:
                break
        if BASELINE in group.built:
            rows += group.time("levers")
        rows += group.failed_rows("levers")
        if confirming:
            lever_rows = [row for row in rows if row["stage"] == "levers"]
            verdicts = lever_verdicts(lever_rows, args.adopt_above)
            adopted, paid_levers = adopted_variant(lever_rows, args.adopt_above)
            same = [name for name, variant in group.variants.items() if variant == adopted and name in group.built]
            notes.append(f"levers at {shape} (paid: median x_tokens >= {args.adopt_above}, every round above 1, "
                         f"first-step loss within {LOSS_TOLERANCE}, gradient norm within {GRAD_NORM_TOLERANCE:.0%}): "
                         + "; ".join(f"{name} {verdict}" for name, verdict in verdicts.items()))
            notes.append(f"adopted (the levers that paid alone at {shape}, together): "
                         + (", ".join(paid_levers) if paid_levers else "none") + (f", the same as {same[0]}" if same else ""))
            if adopted is not None and BASELINE in group.built:
                # Timed again in rounds of their own: the lever rows picked the winners among
                # several, so their ratios lean high; a set that does not pay here is not adopted.
                group.drop(keep={BASELINE, *same[:1]})
                timed = bool(same) or group.build(ADOPTED, adopted)
                if timed:
                    rows += group.time("adopted")
                rows += group.failed_rows("adopted")
                why = not_confirmed(rows, args.adopt_above)
                if why:
                    notes.append(f"adopted: none (the levers together {why} at {shape})")
                    adopted = None
        group.drop(keep=set())
        done(shape)
    return result(partial=False)

