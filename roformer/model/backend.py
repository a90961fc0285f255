"""The one seam between the model's math and what a backend's compiler needs.

The definitions live with the model (rope.py: RoPE as eq. 34's complex product; attention.py,
dense.py, encoder.py). Some compile badly as written on one backend, XLA:CPU above all, so the
model asks this module for the form to run. Every form computes its definition's values (the
tests compare them); only the shapes, layouts and gradient rules the compiler sees differ.

Which backend runs which form, and why (the numbers are on the dated pages in
docs/results/, which also say how they were measured):

  shared_table        XLA:CPU only. The RoPE cis table goes inside a `lax.cond`, which
                      XLA never fuses across, so it is one array computed once per forward
                      pass; otherwise XLA:CPU fuses the small cos/sin producer into every
                      consumer and recomputes it per head, in every layer, forward and
                      backward. Elsewhere the table is computed plainly: on GPU a
                      conditional syncs with the host, and there is no refusion to stop.
                      (archive/2026-11-22-performance-cpu.md, item 3)
  rope_rotation       every backend. RoPE's product with its own jvp rule, whose x tangent
                      is written in real arithmetic for its transpose (the backward pass, a
                      rotation by conj(cis)); autodiff's transpose of the complex product
                      indexes and selects, which XLA:CPU runs slowly. For float32 input with
                      interleaved pairs, (Re, Im) go back into their pairs by a select
                      (`rotate_pairs`) rather than a stack, which XLA:CPU emits as a branch per
                      element; bf16 input keeps the stack, where the select is the slow one.
                      Other backends run the same form; they have not been measured without
                      it. (archive/2026-11-22-performance-cpu.md, items 1-2;
                      archive/2026-11-25-rope-pairs-cpu.md)
  attention_path      which softmax attention runs. For attention_impl="auto": on XLA:CPU
                      attention written out with head-major operands
                      (attention.explicit_softmax_attention) instead of
                      jax.nn.dot_product_attention, whose choice on CPU is its XLA kernel;
                      XLA:CPU's dot library multiplies the [B x H] plain matrices faster than
                      the head-interleaved layout (archive/2026-11-25-attention-dots-cpu.md). On a GPU
                      the fused cuDNN kernel wherever the model allows it (bf16/fp16, head
                      size), since jax's own default is its XLA kernel; elsewhere XLA's.
                      Padding reaches a kernel in the form it takes (attention.kernel_padding).
  token_matmul        every backend (the dense layers' dot_general). The input flattened to
                      [tokens, features], so the weight gradient is a plain matrix product
                      instead of one XLA:CPU prepares by writing the activations out
                      transposed. Elsewhere it is a free reshape, not measured without it.
                      (archive/2026-11-25-dense-layout-cpu.md)
  tied_decoder        every backend. The MLM decoder with its backward written out, so the
                      bias gradient is a matrix-vector product instead of a reduction over
                      the [tokens, vocab] cotangent, which XLA:CPU runs slowly.
                      (archive/2026-11-25-train-step-profile-cpu.md)

Forms for accelerators, each on only where a backend's default set (`DEFAULT_FORMS`)
names it: on a GPU bf16_mlm_logits and fused_mlm_loss, which the GPU cost model predicts pay
and no GPU measurement has shown to lose (2026-12-07-gpu-cost-model.md; the CPU checks:
2026-11-27-levers-cpu.md). Each is switched per process
by ROFORMER_BACKEND_FORMS (the names, comma-separated, replacing the default set) or, while a
step is traced, by `using_forms` (what `python -m roformer.bench levers` does to time them
side by side in one process):

  rope_half_pairs     RoPE without the pair stack. The q and k kernels' (and biases')
                      columns are permuted inside each head at call time, so the projections
                      give each interleaved pair (2j, 2j+1) as split halves (j, j + R/2) and
                      the rotation is a multiply-add over two contiguous halves instead of a
                      stack of (Re, Im) into the minor axis. q.k is unchanged when q and k get
                      the same permutation, so attention computes the same values; the
                      parameters (checkpoints, HF export) keep the interleaved layout.
                      Softmax attention with rope on q and k only (not rotary_value).
  fused_qkv           q, k and v from one GEMM: the three kernels (and biases) concatenated at
                      call time, the input read once, the three gradients one product each way.
  bf16_mlm_logits     With bfloat16 compute, the MLM decoder's logits [predictions, vocab] in
                      bfloat16 (its GEMM accumulates in float32) rather than float32: half the
                      bytes through the loss and its gradient. The loss still takes its
                      log-sum-exp in float32 (roformer.train.steps.mlm_sums upcasts inside the
                      reduction), so only the logits' rounding changes.
  fused_mlm_loss      The MLM loss (cross-entropy at the masked positions, and whether the label
                      is the top logit) with its own backward (`label_losses`): the logits are
                      read in their dtype in each pass, the label's logit picked by an iota
                      compare, and the gradient written in one pass as softmax - one-hot. The
                      plain form (optax's loss and take_along_axis) has XLA write the logits as
                      float32 and scatter the label's gradient into a zero [predictions, vocab]
                      array.

  pallas_residual_norm
                      The post-LN block's tail, LayerNorm(x + dropout(dense(h))), after
                      attention and after the MLP: the dense layer's product without its
                      bias, then one Pallas kernel forward and one backward for the rest
                      (roformer/model/pallas_norm.py) instead of XLA's fusions. The forward
                      reads x, the product and the keep mask once and writes the output (and
                      the sum the backward reads); the backward writes the gradients of x and
                      of the product, and per-program partial sums of the gradients of the
                      dense bias and the norm's scale and bias (no reduction over the
                      product's gradient for the dense bias). The keep mask is the one
                      nnx.Dropout would draw (the same key), so only float rounding changes. Compiled by Triton on a GPU; on the CPU the same
                      kernels run in Pallas's interpret mode (slow; it is what the tests
                      check); refused elsewhere, and on a mesh of several devices (XLA
                      cannot partition the kernel's call). Pre-LN layers keep their form.

Two more levers of the A/B are settings, not forms: train.dropout_rng_impl and the batch.
A new backend-specific form goes here, with a line in this table and a dated page; the model
calls it by name and never branches on the backend.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from roformer.errors import ConfigError


_targets: list[str] = []   # targeting's stack


def target_platform() -> str:
    """The platform the step traced now is for: jax's default backend, or the one `targeting`
    names while it is open (a step compiled on this host for another kind of device)."""
    return _targets[-1] if _targets else jax.default_backend()


@contextlib.contextmanager
def targeting(name: str) -> Iterator[str]:
    """Trace for platform `name` ("gpu", "tpu", "cpu") whatever this host runs: every choice
    of this seam (forms, attention path, the default set) is then that platform's
    (roformer.deviceless compiles a GPU's step on a CPU-only host this way)."""
    _targets.append(name)
    try:
        yield name
    finally:
        _targets.pop()


def on_cpu() -> bool:
    return target_platform() == "cpu"


# ---- Forms switched per process (the accelerator levers) ------------------------------

FORMS = ("rope_half_pairs", "fused_qkv", "bf16_mlm_logits", "pallas_residual_norm", "fused_mlm_loss")
# The forms that run a hand-written kernel, which may fail to lower where the XLA forms do not.
KERNEL_FORMS = ("pallas_residual_norm",)
# The forms each platform runs by default: a form joins its platform's set once a measurement
# there shows it pays (a dated page in docs/results/).
# On a GPU: the MLM loss's two forms, which the cost model (python -m roformer.bench cost)
# predicts pay and no GPU measurement has shown to lose (docs/results/2026-12-07-gpu-cost-model.md).
DEFAULT_FORMS: dict[str, frozenset[str]] = {"cpu": frozenset(), "gpu": frozenset({"bf16_mlm_logits", "fused_mlm_loss"}),
                                            "tpu": frozenset()}
FORMS_ENV = "ROFORMER_BACKEND_FORMS"
_forced: list[frozenset[str]] = []   # using_forms' stack


def parse_forms(text: str) -> frozenset[str]:
    """A comma-separated list of form names (empty: none), checked against FORMS."""
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - set(FORMS))
    if unknown:
        raise ConfigError(f"unknown backend form(s) {unknown}; choose from {list(FORMS)}")
    return names


def active_forms() -> frozenset[str]:
    """The forms a step traced now takes: `using_forms`' set while one is open, else
    ROFORMER_BACKEND_FORMS when set, else this platform's default set."""
    if _forced:
        return _forced[-1]
    if FORMS_ENV in os.environ:
        return parse_forms(os.environ[FORMS_ENV])
    return DEFAULT_FORMS.get(target_platform(), frozenset())


@contextlib.contextmanager
def using_forms(names: Iterable[str]) -> Iterator[frozenset[str]]:
    """Trace with exactly these forms on (an A/B in one process). The choice is made when a
    function is traced, so a jitted step keeps the forms it was compiled with."""
    forms = parse_forms(",".join(names))
    _forced.append(forms)
    try:
        yield forms
    finally:
        _forced.pop()


def rope_half_pairs() -> bool:
    return "rope_half_pairs" in active_forms()


def fused_qkv() -> bool:
    return "fused_qkv" in active_forms()


def pallas_residual_norm() -> bool:
    return "pallas_residual_norm" in active_forms()


def residual_layer_norm(x, y, y_bias, keep, scale, bias, *, keep_prob: float, epsilon: float) -> jax.Array:
    """LayerNorm(x + where(keep, (y + y_bias) / keep_prob, 0)) by pallas_norm's kernels: compiled on a
    GPU, interpreted on the CPU; other platforms and meshes of several devices are refused (a
    ConfigError: XLA would gather the kernel's operands onto every device)."""
    target, mesh = target_platform(), jax.sharding.get_abstract_mesh()
    if target not in ("gpu", "cpu"):
        raise ConfigError(f"backend form pallas_residual_norm runs on GPUs (or interpreted on the CPU), "
                          f"not on {target}; leave it out of {FORMS_ENV}")
    if not mesh.empty and mesh.size > 1:
        raise ConfigError(f"backend form pallas_residual_norm runs on one device, not on a mesh of "
                          f"{mesh.size}; leave it out of {FORMS_ENV}")
    from roformer.model import pallas_norm   # jax's Pallas is imported only where the form runs

    return pallas_norm.residual_layer_norm(x, y, y_bias, keep, scale, bias, keep_prob=keep_prob,
                                           epsilon=epsilon, interpret=target == "cpu")


def fused_mlm_loss() -> bool:
    return "fused_mlm_loss" in active_forms()


def label_losses(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy, correct) per prediction of logits [..., V] (any float dtype) and integer
    labels [...], as roformer.train.steps.mlm_sums defines them (correct: the label's logit is
    the maximum): the fused_mlm_loss form. The logits are read in their own dtype and taken to
    float32 inside each pass; the label's logit is picked by comparing an iota with the label,
    and the backward is one elementwise pass, softmax - one-hot, times the loss's cotangent:
    no float32 copy of the logits, no scatter (take_along_axis's transpose)."""
    losses, correct, _ = _label_losses(logits, labels)
    return losses, correct


def _label_terms(logits, labels):
    x = logits.astype(jnp.float32)
    top = jnp.max(x, axis=-1)
    log_sum = top + jnp.log(jnp.sum(jnp.exp(x - top[..., None]), axis=-1))
    hit = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == labels[..., None]
    label_logit = jnp.sum(jnp.where(hit, x, 0.0), axis=-1)
    return log_sum - label_logit, (label_logit >= top).astype(jnp.float32), log_sum


@jax.custom_vjp
def _label_losses(logits, labels):
    return _label_terms(logits, labels)


def _label_losses_fwd(logits, labels):
    losses, correct, log_sum = _label_terms(logits, labels)
    return (losses, correct, log_sum), (logits, labels, log_sum)


def _label_losses_bwd(residuals, cotangents):
    logits, labels, log_sum = residuals
    d_losses = cotangents[0]   # correct and log_sum are not differentiated
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == labels[..., None]
    probs = jnp.exp(logits.astype(jnp.float32) - log_sum[..., None])
    d_logits = (probs - hit.astype(jnp.float32)) * d_losses[..., None]
    return d_logits.astype(logits.dtype), None


_label_losses.defvjp(_label_losses_fwd, _label_losses_bwd)


def mlm_logits_dtype(compute_dtype) -> jnp.dtype:
    """The MLM decoder's output dtype: float32, or bfloat16 under bf16_mlm_logits with bf16
    compute."""
    if compute_dtype == jnp.bfloat16 and "bf16_mlm_logits" in active_forms():
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


# ---- RoPE -----------------------------------------------------------------------------

def shared_table(table: Callable[[jax.Array], jax.Array], positions: jax.Array) -> jax.Array:
    """table(positions), computed once per forward pass however many layers read it."""
    if not on_cpu():
        return table(positions)
    # Both branches are the same table: the predicate's value is irrelevant, it only has to
    # be traced, and the conditional keeps XLA:CPU from fusing the table into its consumers.
    return jax.lax.cond(jnp.sum(positions) >= 0, table, table, positions)


def rotate_pairs(pairs: jax.Array, cis: jax.Array) -> jax.Array:
    """pairs [..., H, R/2, 2] float32, each (Re, Im) one complex number, times cis [..., R/2]
    (shared over heads), returned as pairs: the interleaved product with (Re, Im) put back by
    a select on the pair slot.

    On XLA:CPU this loop vectorises when its result stays [..., R/2, 2]; flattened to
    [..., R] in the same fusion the loop runs over features with the pair index recomputed
    per element (docs/results/archive/2026-11-25-rope-pairs-cpu.md)."""
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    is_real_slot = jax.lax.broadcasted_iota(jnp.int32, pairs.shape, pairs.ndim - 1) == 0
    return jnp.where(is_real_slot, z.real[..., None], z.imag[..., None])


def rope_rotation(product: Callable[[jax.Array, jax.Array, str], jax.Array]):
    """The rotation apply_rope runs, built from `product(x, cis, layout)`, the definition
    (rope.complex_product: x [..., H, R] float32 as R/2 complex numbers times cis [..., R/2]).

    Returns `rotate(x, cis, layout, input_dtype)`: the same values as `product`, with the
    interleave and the jvp rule described in this module's docstring. `input_dtype` is the
    dtype x had before its upcast to float32, which decides the interleave."""

    def forward(x, cis, layout, interleave):
        if layout == "interleaved" and interleave == "select":
            half = cis.shape[-1]
            return rotate_pairs(x.reshape(*x.shape[:-1], half, 2), cis).reshape(x.shape)
        return product(x, cis, layout)

    @functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
    def rotate(x, cis, layout, interleave):
        return forward(x, cis, layout, interleave)

    def rotate_jvp(layout, interleave, primals, tangents):
        """The product is linear in x and in cis: its tangent is x_dot * cis + x * cis_dot.
        Reverse mode transposes this linear map, so jvp, grad and every higher order come
        from this one rule. A cis without tangent (cis from integer positions) adds no term."""
        x, cis = primals
        x_dot, cis_dot = tangents
        out = forward(x, cis, layout, interleave)
        terms = []
        if type(x_dot) is not SymbolicZero:
            terms.append(_rotation_tangent(x_dot, cis, layout, interleave))
        if type(cis_dot) is not SymbolicZero:
            terms.append(forward(x, cis_dot, layout, interleave))
        return out, functools.reduce(jnp.add, terms)

    rotate.defjvp(rotate_jvp, symbolic_zeros=True)

    def run(x, cis, layout, input_dtype):
        return rotate(x, cis, layout, "select" if input_dtype == jnp.float32 else "stack")

    return run


def _rotation_tangent(x_dot: jax.Array, cis: jax.Array, layout: str, interleave: str) -> jax.Array:
    """x_dot * cis in real arithmetic, written for its transpose (the backward pass, a
    rotation by conj(cis)) rather than for itself: the pairs are taken apart by a split,
    whose transpose is a concatenate, or for float32 interleaved pairs swapped by a reverse
    of the pair axis, a branch-free loop on XLA:CPU."""
    half = cis.shape[-1]
    cos, sin = jnp.real(cis)[..., None, :], jnp.imag(cis)[..., None, :]
    if layout == "half":
        re, im = jax.lax.split(x_dot, (half, half), axis=x_dot.ndim - 1)
        return jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1)
    pairs = x_dot.reshape(*x_dot.shape[:-1], half, 2)
    cos, sin = cos[..., None], sin[..., None]
    if interleave == "select":  # float32 input
        swapped = pairs[..., ::-1] * jnp.concatenate([-sin, sin], axis=-1)
        return (pairs * cos + swapped).reshape(x_dot.shape)
    re, im = jax.lax.split(pairs, (1, 1), axis=pairs.ndim - 1)
    return jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x_dot.shape)


# ---- Attention ------------------------------------------------------------------------

# Softmax attention paths: "explicit" (attention.explicit_softmax_attention), or one of
# jax.nn.dot_product_attention's kernels, "xla" (portable) and "cudnn" (fused, GPU only).
ATTENTION_PATHS = ("explicit", "xla", "cudnn")
# cuDNN's fused kernel takes half-precision q/k/v whose head size is a multiple of 8 up to 128.
FUSED_DTYPES = ("bfloat16", "float16")
FUSED_MAX_HEAD_DIM = 128


def attention_path(implementation: str, *, dtype, head_dim: int, dropout_active: bool = False,
                   relative_kv: bool = False, platform: str | None = None) -> tuple[str, str]:
    """(path, why): which softmax attention runs for `attention_impl=implementation`, and a
    short reason a run's start-up line shows.

    `dropout_active`: attention dropout is on (training with attention_dropout > 0); no
    kernel drops probabilities, so the written-out form runs. `relative_kv`: the scheme adds
    relative terms to keys and values (Shaw), which no kernel takes. "auto" takes the fused
    cuDNN kernel on a GPU wherever the model allows it (half precision, head size), XLA's
    kernel on other accelerators, and on XLA:CPU the written-out form with head-major
    operands, whose batched dots its dot library runs faster (archive/2026-11-25-attention-dots-cpu.md).
    """
    platform = platform or target_platform()
    if relative_kv:
        return "explicit", "written out (Shaw relative keys and values: no kernel takes them)"
    if dropout_active:
        return "explicit", ("written out (attention_dropout > 0 while training; set "
                            "model.attention_dropout=0 for the fused kernel)")
    if implementation in ("xla", "cudnn"):
        return implementation, f"{implementation} (attention_impl={implementation})"
    if platform == "cpu":
        return "explicit", "written out, head-major (auto on CPU)"
    if platform not in ("gpu", "cuda"):
        return "xla", f"xla (auto on {platform})"
    refused = fused_kernel_refusal(platform=platform, dtype=dtype, head_dim=head_dim)
    if refused:
        return "xla", f"xla (auto: cuDNN's fused kernel {refused})"
    return "cudnn", "cudnn fused kernel (auto on GPU)"


def fused_kernel_refusal(*, platform: str, dtype, head_dim: int) -> str | None:
    """Why cuDNN's fused kernel cannot take inputs of this device, dtype and head size, or
    None when it can (what attention_path's auto and attention.check_attention_impl ask)."""
    dtype = jnp.dtype(dtype).name
    if platform not in ("gpu", "cuda"):
        return f"runs on NVIDIA GPUs only and this run's devices are {platform}"
    if dtype not in FUSED_DTYPES:
        return f"takes bf16/fp16 inputs and model.dtype is {dtype}; set model.dtype=bfloat16"
    if head_dim % 8 or head_dim > FUSED_MAX_HEAD_DIM:
        return f"takes head sizes that are multiples of 8 up to {FUSED_MAX_HEAD_DIM}, not {head_dim}"
    return None


# ---- Dense layers and the MLM decoder -------------------------------------------------

def token_matmul(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                 out_sharding=None):
    """jax.lax.dot_general for nnx.Linear, with lhs's leading axes merged into one."""
    (lhs_contract, rhs_contract), batch_dims = dimension_numbers
    plain = lhs.ndim <= 2 or out_sharding is not None or batch_dims != ((), ()) \
        or tuple(lhs_contract) != (lhs.ndim - 1,) or tuple(rhs_contract) != (0,) or rhs.ndim != 2
    if plain:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                   out_sharding=out_sharding)
    out = jax.lax.dot_general(lhs.reshape(-1, lhs.shape[-1]), rhs, (((1,), (0,)), ((), ())),
                              precision, preferred_element_type)
    return out.reshape(*lhs.shape[:-1], rhs.shape[-1])


def tied_decoder(x: jax.Array, table: jax.Array, bias: jax.Array) -> jax.Array:
    """Logits x @ table.T + bias: [..., E] x [V, E] -> [..., V], float32 (bfloat16 under the
    bf16_mlm_logits form with bf16 x: `mlm_logits_dtype`).

    Its gradients are autodiff's, written out so that the bias gradient is a matrix-vector
    product (ones @ d_logits) rather than a reduction over the [N, V] cotangent. Reverse
    mode only (grad of grad works; jvp through the MLM head does not)."""
    return _tied_decoder(x, table, bias, mlm_logits_dtype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tied_decoder(x, table, bias, out_dtype):
    return _tied_logits(x, table, bias, out_dtype)


def _tied_logits(x, table, bias, out_dtype):
    return jnp.einsum("...e,ve->...v", x, table, preferred_element_type=out_dtype) + bias.astype(out_dtype)


def _tied_decoder_fwd(x, table, bias, out_dtype):
    return _tied_logits(x, table, bias, out_dtype), (x, table)


def _tied_decoder_bwd(out_dtype, residuals, d_logits):
    x, table = residuals
    rows = d_logits.reshape(-1, d_logits.shape[-1])
    d_x = jnp.einsum("...v,ve->...e", d_logits.astype(table.dtype), table, preferred_element_type=jnp.float32)
    d_table = jnp.einsum("nv,ne->ve", rows.astype(x.dtype), x.reshape(-1, x.shape[-1]),
                         preferred_element_type=jnp.float32)
    d_bias = jnp.matmul(jnp.ones(rows.shape[:1], rows.dtype), rows, preferred_element_type=jnp.float32)
    return d_x.astype(x.dtype), d_table.astype(table.dtype), d_bias


_tied_decoder.defvjp(_tied_decoder_fwd, _tied_decoder_bwd)
