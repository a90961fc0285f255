"""RoPE formulations vs a scale-copy: ms, GB/s and ratios from alternating runs.

Every formulation rotates the same [batch, length, heads, head_dim] tensor by a
position table computed once beforehand, because that is how the model uses RoPE:
`rope_cis` runs once per forward pass and every layer's q and k reuse it (its own
cost is reported in the `cis_table` row). Variants:
  copy              x * scale: one read and one write, the memory-bandwidth floor
  complex           roformer.model.rope.apply_rope, interleaved pairs (paper, HF; the default)
  complex_half      roformer.model.rope.apply_rope, split-half pairs (planar complex layout)
  complex_stack     the same complex64 product written the obvious way: (Re, Im) stacked
                    back on the pair axis, autodiff backward (apply_rope before its tuning)
  complex_pairs     the f32 product of `complex` (roformer.model.backend.rotate_pairs) on x given and
                    returned as [..., head_dim / 2, 2] pairs, not flattened to head_dim;
                    backward: the product by conj(cis). What the product costs when XLA
                    does not flatten its result in the same loop (apply_rope's result is
                    flattened, as attention needs it)
  real_interleaved  x0 cos - x1 sin, x0 sin + x1 cos on the (2j, 2j+1) pairs
  rotate_half       x cos + rotate_half(x) sin (GPT-NeoX / LLaMA form)
  call              a jitted call that reads and writes almost nothing (one element): what
                    every row pays per call for dispatch, so small shapes can be read
The input is upcast to float32 for the product and cast back (bf16 input stays bf16
in and out for every variant, copy included). One run covers every combination of
--lengths, --batches, --passes (fwd; fwd+bwd = the VJP as in a train step) and
--dtypes; each (shape, pass) times all variants in alternating rounds, and every row
carries its time over the copy's (x_copy) and over the fastest real form's of that
shape (x_real), medians of per-round ratios with min and max.
"""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from roformer import cli
from roformer.bench.common import alternate, ratio_stats
from roformer.model import backend, rope

REAL_FORMS = ("real_interleaved", "rotate_half")
PASSES = ("fwd", "fwd+bwd")
TABLE_COLUMNS = ("shape", "dtype", "pass", "variant", "ms", "GB/s", "x_copy", "x_copy_min", "x_copy_max",
                 "x_real", "x_real_min", "x_real_max")


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--lengths", type=int, many=True, default=[128, 256, 512, 1024, 2048, 4096],
                   help="sequence lengths (tokens per row)")
    command.define("--batches", type=int, many=True, default=[1, 8], help="rows per tensor")
    command.define("--passes", many=True, default=list(PASSES), choices=PASSES)
    command.define("--heads", type=int, default=12)
    command.define("--head-dim", type=int, default=64)
    command.define("--dtypes", many=True, default=["float32"], choices=["float32", "bfloat16"])
    command.define("--rounds", type=int, default=7, help="alternating rounds per shape")
    command.define("--iters", type=int, default=5, help="calls per variant per round (median taken)")


def scale_copy(x):
    return x * jnp.asarray(1.0001, x.dtype)


def call_only(x):
    """One element of x, scaled: a call's fixed cost without the data (same in both passes)."""
    return x[:1, :1, :1, :1] * jnp.asarray(1.0001, x.dtype)


def complex_interleaved(x, cis):
    return rope.apply_rope(x, cis, layout="interleaved")


def complex_half(x, cis):
    return rope.apply_rope(x, cis, layout="half")


def complex_stack(x, cis):
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    return jnp.stack([z.real, z.imag], axis=-1).reshape(x.shape).astype(x.dtype)


@jax.custom_vjp
def complex_pairs(pairs, cis):
    return backend.rotate_pairs(pairs.astype(jnp.float32), cis).astype(pairs.dtype)


def _complex_pairs_fwd(pairs, cis):
    return complex_pairs(pairs, cis), cis


def _complex_pairs_bwd(cis, cotangent):
    """A rotation's transpose is the rotation by the conjugate."""
    return complex_pairs(cotangent, jnp.conj(cis)), jnp.zeros_like(cis)


complex_pairs.defvjp(_complex_pairs_fwd, _complex_pairs_bwd)


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
    """The per-forward tables each formulation consumes, built by roformer.model.rope."""
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


def bench_shape(batch, length, heads, head_dim, dtype, *, backward, rounds, iters) -> list[dict]:
    """Alternating rounds of every variant on one shape and pass; one row per variant."""
    x = jax.random.normal(jax.random.key(0), (batch, length, heads, head_dim), dtype=dtype)
    cotangent = jax.random.normal(jax.random.key(1), x.shape, dtype=dtype)
    positions, cis_fn, t = position_tables(batch, length, head_dim)
    as_pairs = (batch, length, heads, head_dim // 2, 2)
    variants = {
        "copy": timed(scale_copy, x, (), backward, cotangent),
        "complex": timed(complex_interleaved, x, (t["cis"],), backward, cotangent),
        "complex_half": timed(complex_half, x, (t["cis"],), backward, cotangent),
        "complex_stack": timed(complex_stack, x, (t["cis"],), backward, cotangent),
        "complex_pairs": timed(complex_pairs, x.reshape(as_pairs), (t["cis"],), backward,
                               cotangent.reshape(as_pairs)),
        "real_interleaved": timed(real_interleaved, x, (t["cos"], t["sin"]), backward, cotangent),
        "rotate_half": timed(rotate_half, x, (t["cos_full"], t["sin_full"]), backward, cotangent),
        "cis_table": lambda: cis_fn(positions),
        "call": timed(call_only, x, (), False, cotangent),
    }
    times = alternate(variants, rounds=rounds, iters=iters)
    moved = (4 if backward else 2) * x.size * x.dtype.itemsize  # read x (+ cotangent), write result(s)
    fastest_real = min(REAL_FORMS, key=lambda n: np.median(times[n]))
    rows = []
    for name, seconds in times.items():
        ms = float(np.median(seconds)) * 1e3
        vs_copy, vs_real = ratio_stats(seconds, times["copy"]), ratio_stats(seconds, times[fastest_real])
        rows.append({"shape": f"{batch}x{length}x{heads}x{head_dim}", "batch": batch, "length": length,
                     "tokens": batch * length, "dtype": dtype, "pass": PASSES[backward], "variant": name,
                     "ms": ms, "GB/s": None if name in ("cis_table", "call") else moved / ms / 1e6,
                     "x_copy": vs_copy["median"], "x_copy_min": vs_copy["min"], "x_copy_max": vs_copy["max"],
                     "fastest_real": fastest_real,
                     "x_real": vs_real["median"], "x_real_min": vs_real["min"], "x_real_max": vs_real["max"]})
    return rows


def run(args: SimpleNamespace) -> dict:
    rows = []
    for dtype in args.dtypes:
        for batch in args.batches:
            for length in args.lengths:
                for pass_name in args.passes:
                    rows += bench_shape(batch, length, args.heads, args.head_dim, dtype,
                                        backward=pass_name == "fwd+bwd", rounds=args.rounds, iters=args.iters)
    return {"rows": rows, "columns": TABLE_COLUMNS,
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}
