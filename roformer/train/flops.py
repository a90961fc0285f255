"""Analytic training FLOPs of the MLM model, device peak FLOP/s and MFU.

Counts matmul FLOPs only (2 per multiply-add), forward x 3 for forward+backward,
as in PaLM/MaxText. The MLM head is counted at the masked positions only, since
the model computes logits only there.
"""
from __future__ import annotations

import jax

# Dense peak FLOP/s per device: (bf16, f32). Matched by substring of
# `device.device_kind`, first match wins (more specific names first). A jax device is a
# chip from TPU v4 on and one of a chip's two cores on v2/v3 (half the chip's peak).
# The f32 column is what jax's default matmul precision runs on: bf16 passes on a TPU, TF32
# tensor cores on an NVIDIA GPU from Ampere on (half the bf16 peak), plain f32 on a V100.
PEAK_FLOPS: tuple[tuple[str, tuple[float, float]], ...] = (
    ("TPU v6", (918e12, 918e12 / 4)),
    ("TPU v5 lite", (197e12, 197e12 / 4)),   # v5e
    ("TPU v5", (459e12, 459e12 / 4)),        # v5p: "TPU v5" on a TPU VM, "TPU v5p" elsewhere
    ("TPU v4", (275e12, 275e12 / 4)),
    ("TPU v3", (61.5e12, 61.5e12 / 4)),
    ("TPU v2", (22.5e12, 22.5e12 / 4)),
    ("H200 NVL", (835e12, 835e12 / 2)),
    ("H200", (989e12, 989e12 / 2)),          # SXM, and GH200's
    ("H100 PCIe", (756e12, 756e12 / 2)),
    ("H100 NVL", (835e12, 835e12 / 2)),
    ("H100", (989e12, 989e12 / 2)),          # SXM ("H100 80GB HBM3")
    ("A100", (312e12, 156e12)),
    ("L40S", (362e12, 181e12)),
    ("L40", (181e12, 90.5e12)),
    ("L4", (121e12, 60.5e12)),
    ("A10G", (125e12, 62.5e12)),
    ("V100", (125e12, 15.7e12)),             # no TF32: f32 runs on the CUDA cores
    ("RTX 4090", (165e12, 82.6e12)),
    ("RTX 3090", (71e12, 35.6e12)),
)


def train_flops_per_step(model_cfg, *, batch_size: int, seq_len: int, num_predictions: int,
                         segmented: bool = False) -> float:
    """Matmul FLOPs of one optimizer step (forward + backward) for a global batch.

    `num_predictions` is the number of masked-position slots per sequence (P). `segmented`:
    rows of packed documents (segment ids), where linear attention runs its quadratic form
    (roformer.model.attention.linear_attention)."""
    h, layers, inter = model_cfg.hidden_size, model_cfg.num_layers, model_cfg.intermediate_size
    emb = model_cfg.embedding_size or h
    head_dim = h // model_cfg.num_heads
    per_token_params = layers * (4 * h * h + 2 * h * inter)    # q, k, v, out + MLP
    if emb != h:
        per_token_params += emb * h                              # embeddings_project
    if model_cfg.attention == "linear" and segmented:
        attention = layers * 6 * seq_len * h                      # scores, their weights, and P V
    elif model_cfg.attention == "linear":
        attention = layers * 4 * h * head_dim                     # K^T V and Q (K^T V)
    else:
        attention = layers * 4 * seq_len * h                      # Q K^T and P V
    forward_per_token = 2 * per_token_params + attention
    head_per_prediction = 2 * (h * emb + emb * model_cfg.vocab_size)  # transform + decoder
    forward = batch_size * (seq_len * forward_per_token + num_predictions * head_per_prediction)
    return 3.0 * forward


def device_peak_flops(device: jax.Device, compute_dtype: str = "bfloat16",
                      configured: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: `configured` if > 0, else the table; None (MFU not
    reported) for a CPU or an accelerator the table lacks. A CPU's peak depends on what
    else runs on the host from one minute to the next: a matmul timed at start-up put MFU
    above 1 once the load changed, and timing one beside every logged interval would slow
    the run."""
    if configured > 0:
        return configured
    column = 0 if compute_dtype == "bfloat16" else 1
    for name, peaks in PEAK_FLOPS:
        if name.lower() in device.device_kind.lower():
            return peaks[column]
    return None


def mfu(flops_per_step: float, steps_per_sec: float, peak_per_device: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved / (peak x devices)."""
    return flops_per_step * steps_per_sec / (peak_per_device * num_devices)
