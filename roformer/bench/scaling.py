"""Train-step time vs sequence length (128 -> 2048) for each position scheme.

The number of tokens per step is held fixed (batch = tokens / length), so a
scheme whose cost were linear in length would keep a flat time per token; the
growth column is each scheme's time per token relative to its own time at the
shortest length. All schemes of one length run in alternating rounds (see `step`).
"""
from __future__ import annotations

from types import SimpleNamespace

from roformer import cli
from roformer.bench import step
from roformer.errors import ConfigError
from roformer.model import PRESETS
from roformer.model.positions import POSITION_SCHEMES


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--size", default="tiny", choices=list(PRESETS))
    command.define("--seq-lens", type=int, many=True, default=[128, 256, 512, 1024, 2048])
    command.define("--tokens", type=int, default=4096, help="tokens per step (batch = tokens / length)")
    command.define("--schemes", many=True, default=list(POSITION_SCHEMES), choices=sorted(POSITION_SCHEMES))
    command.define("--dtype", default="float32", choices=["float32", "bfloat16"])
    command.define("--attention-impl", default="auto", choices=step.ATTENTION_IMPLEMENTATIONS)
    command.define("--attention-dropout", type=float, default=None)
    command.define("--vocab-size", type=int, default=30522)
    command.define("--peak-size", type=int, default=0, help="matmul side for the peak probe (0: auto)")
    command.define("--rounds", type=int, default=3)
    command.define("--iters", type=int, default=2)


def run(args: SimpleNamespace) -> dict:
    for seq_len in args.seq_lens:
        if args.tokens % seq_len:
            raise ConfigError(f"--tokens {args.tokens} must be a multiple of every --seq-lens entry ({seq_len})")
    rows, first_ms_per_token = [], {}
    for seq_len in sorted(args.seq_lens):
        group_rows = step.bench_group(args.size, seq_len, args.tokens // seq_len, args.schemes, args,
                                         max_len=max(args.seq_lens))
        for row in group_rows:
            ms_per_ktok = row["ms_step"] / (row["batch"] * row["seq"]) * 1e3
            first_ms_per_token.setdefault(row["scheme"], ms_per_ktok)
            rows.append({"scheme": row["scheme"], "seq": row["seq"], "batch": row["batch"],
                         "ms_step": row["ms_step"], "ms_per_1k_tokens": ms_per_ktok,
                         "growth": ms_per_ktok / first_ms_per_token[row["scheme"]],
                         "x_learned": row.get("x_learned"), "mfu": row["mfu"]})
    rows.sort(key=lambda r: (r["scheme"], r["seq"]))
    return {"rows": rows, "settings": {k: v for k, v in vars(args).items() if k != "json"}}
