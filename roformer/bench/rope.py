"""RoPE formulations vs a scale-copy: ms, GB/s and ratios from alternating runs.

Every formulation rotates the same [batch, length, heads, head_dim] tensor by a
position table computed once beforehand, because that is how the model uses RoPE:
`rope_cis` runs once per forward pass and every layer's q and k reuse it (its own
cost is reported in the `cis_table` row). Variants:
  copy              x * scale: one read and one write, the memory-bandwidth floor
  complex           roformer.rope.apply_rope, interleaved pairs (paper, HF; the default)
  complex_half      roformer.rope.apply_rope, split-half pairs (planar complex layout)
  complex_stack     the same complex64 product written the obvious way: (Re, Im) stacked
                    back on the pair axis, autodiff backward (apply_rope before its tuning)
  real_interleaved  x0 cos - x1 sin, x0 sin + x1 cos on the (2j, 2j+1) pairs
  rotate_half       x cos + rotate_half(x) sin (GPT-NeoX / LLaMA form)
The input is upcast to float32 for the product and cast back (bf16 input stays bf16
in and out for every variant, copy included). With --backward every variant is
timed as forward + backward (its VJP), as in a train step.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from roformer import rope
from roformer.bench.common import alternate, ratio_stats

TARGET_VS_COPY = 1.5
TARGET_VS_REAL = 1.1
REAL_FORMS = ("real_interleaved", "rotate_half")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 4096],
                        help="sequence lengths (tokens per row)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--backward", action="store_true", help="time forward + backward (VJP) instead")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per shape")
    parser.add_argument("--iters", type=int, default=10, help="calls per variant per round (median taken)")


def scale_copy(x):
    return x * jnp.asarray(1.0001, x.dtype)


def complex_interleaved(x, cis):
    return rope.apply_rope(x, cis, layout="interleaved")


def complex_half(x, cis):
    return rope.apply_rope(x, cis, layout="half")


def complex_stack(x, cis):
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    return jnp.stack([z.real, z.imag], axis=-1).reshape(x.shape).astype(x.dtype)


def real_interleaved(x, cos, sin):
    """Real-arithmetic rotation of pairs (2j, 2j+1); cos/sin [B, L, D/2]."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[..., None, :], sin[..., None, :]
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def rotate_half(x, cos_full, sin_full):
    """x cos + rotate_half(x) sin on split halves; cos/sin [B, L, D] (halves repeated)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos_full[..., None, :] + rotated * sin_full[..., None, :]).astype(x.dtype)


def position_tables(batch: int, length: int, head_dim: int):
    """The per-forward tables each formulation consumes, built by roformer.rope."""
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    inv_freq, magnitude = rope.rope_frequencies(head_dim)
    cis_fn = jax.jit(lambda p: rope.rope_cis(p, inv_freq, magnitude))
    cis = cis_fn(positions)
    cos, sin = jnp.real(cis), jnp.imag(cis)
    tables = {"cis": cis, "cos": cos, "sin": sin,
              "cos_full": jnp.concatenate([cos, cos], -1), "sin_full": jnp.concatenate([sin, sin], -1)}
    return positions, cis_fn, jax.block_until_ready(tables)


def timed(fn, x, tables, backward: bool, cotangent):
    """A zero-argument jitted call of fn(x, *tables), or of its VJP at `cotangent`."""
    if backward:
        jitted = jax.jit(lambda x, g, *t: jax.vjp(lambda x: fn(x, *t), x)[1](g)[0])
        return lambda: jitted(x, cotangent, *tables)
    jitted = jax.jit(fn)
    return lambda: jitted(x, *tables)


def bench_shape(batch, length, heads, head_dim, dtype, *, backward, rounds, iters):
    """Alternating rounds of every variant on one shape; rows + comparisons."""
    x = jax.random.normal(jax.random.key(0), (batch, length, heads, head_dim), dtype=dtype)
    cotangent = jax.random.normal(jax.random.key(1), x.shape, dtype=dtype)
    positions, cis_fn, t = position_tables(batch, length, head_dim)
    variants = {
        "copy": timed(scale_copy, x, (), backward, cotangent),
        "complex": timed(complex_interleaved, x, (t["cis"],), backward, cotangent),
        "complex_half": timed(complex_half, x, (t["cis"],), backward, cotangent),
        "complex_stack": timed(complex_stack, x, (t["cis"],), backward, cotangent),
        "real_interleaved": timed(real_interleaved, x, (t["cos"], t["sin"]), backward, cotangent),
        "rotate_half": timed(rotate_half, x, (t["cos_full"], t["sin_full"]), backward, cotangent),
        "cis_table": lambda: cis_fn(positions),
    }
    times = alternate(variants, rounds=rounds, iters=iters)
    moved = (4 if backward else 2) * x.size * x.dtype.itemsize  # read x (+ cotangent), write result(s)
    shape = f"{batch}x{length}x{heads}x{head_dim}"
    rows = []
    for name, seconds in times.items():
        ms = float(np.median(seconds)) * 1e3
        vs_copy = ratio_stats(seconds, times["copy"])
        rows.append({"shape": shape, "tokens": batch * length, "dtype": dtype,
                     "pass": "fwd+bwd" if backward else "fwd", "variant": name, "ms": ms,
                     "GB/s": None if name == "cis_table" else moved / ms / 1e6,
                     "x_copy": vs_copy["median"], "x_copy_min": vs_copy["min"], "x_copy_max": vs_copy["max"]})
    fastest_real = min(REAL_FORMS, key=lambda n: np.median(times[n]))
    label = f"[{shape} {dtype}{' fwd+bwd' if backward else ''}]"
    comparisons = [
        {"name": f"complex / copy {label}", "rounds": rounds, "kind": "vs_copy",
         **ratio_stats(times["complex"], times["copy"])},
        {"name": f"complex / {fastest_real} (fastest real) {label}", "rounds": rounds, "kind": "vs_real",
         **ratio_stats(times["complex"], times[fastest_real])},
    ]
    return rows, comparisons


def run(args: argparse.Namespace) -> dict:
    rows, comparisons = [], []
    largest = max(args.lengths)
    for dtype in args.dtypes:
        for length in args.lengths:
            shape_rows, shape_comparisons = bench_shape(
                args.batch, length, args.heads, args.head_dim, dtype, backward=args.backward,
                rounds=args.rounds, iters=args.iters)
            rows += shape_rows
            if length == largest:  # the targets are stated on the largest shape
                for comparison in shape_comparisons:
                    target = TARGET_VS_COPY if comparison["kind"] == "vs_copy" else TARGET_VS_REAL
                    comparison.update(target=f"<= {target}", met=comparison["median"] <= target)
            comparisons += shape_comparisons
    return {"rows": rows, "comparisons": comparisons,
            "settings": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
                         "backward": args.backward, "rounds": args.rounds, "iters": args.iters}}
