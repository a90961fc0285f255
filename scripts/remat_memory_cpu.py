"""What `model.remat` saves and costs on this machine (docs/results/2026-12-07-remat-cpu.md).

    python scripts/remat_memory_cpu.py base BATCH LENGTH    # base preset, AdamW step: XLA's buffers, no step run
    python scripts/remat_memory_cpu.py small BATCH LENGTH   # 4 x 128 model, gradient step: buffers and step times

One JSON line per setting (none, full, dots) from the compiled program's memory_analysis().
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from roformer.model import ModelConfig, RoFormerForMaskedLM

SMALL = dict(vocab_size=1000, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512)


def measure(kind: str, remat: str, batch: int, length: int) -> dict:
    config = (ModelConfig.from_preset("base", remat=remat) if kind == "base" else ModelConfig(**SMALL, remat=remat))
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    ids = jnp.ones((batch, length), jnp.int32)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param) if kind == "base" else None

    def loss_fn(model):
        logits = model(ids).astype(jnp.float32)
        if kind == "base":
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()
        return jnp.mean(logits ** 2)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        if optimizer is not None:
            optimizer.update(model, grads)
        return loss

    start = time.perf_counter()
    lowered = step.lower(model, optimizer)
    memory = lowered.compile().memory_analysis()
    row = {"remat": remat, "kind": kind, "batch": batch, "length": length,
           "compile_s": round(time.perf_counter() - start, 1),
           "temp_mib": round(memory.temp_size_in_bytes / 2**20, 1),
           "argument_mib": round(memory.argument_size_in_bytes / 2**20, 1),
           "matmuls": lowered.as_text().count("dot_general"), "jax": jax.__version__}
    if kind == "small":
        jax.block_until_ready(step(model, optimizer))
        times = []
        for _ in range(5):
            tick = time.perf_counter()
            jax.block_until_ready(step(model, optimizer))
            times.append(time.perf_counter() - tick)
        row.update(step_s_min=round(min(times), 3), step_s_median=round(sorted(times)[2], 3))
    return row


if __name__ == "__main__":
    kind, batch, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for remat in ("none", "full", "dots"):
        print(json.dumps(measure(kind, remat, batch, length)), flush=True)
