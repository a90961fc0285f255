"""docs/results/2026-12-07-remat.md, small-model table: `python scripts/remat_small_cpu.py`."""
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx
from roformer.model import ModelConfig, RoFormerForMaskedLM
for remat in ("none", "full", "dots", "none"):
    config = ModelConfig(vocab_size=1000, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512, remat=remat)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    ids = jnp.ones((8, 512), jnp.int32)
    @nnx.jit
    def step(model, ids):
        return nnx.value_and_grad(lambda m: jnp.mean(m(ids).astype(jnp.float32) ** 2))(model)
    lowered = step.lower(model, ids)
    c = lowered.compile()
    jax.block_until_ready(step(model, ids))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(step(model, ids))
        times.append(time.perf_counter() - t)
    print(json.dumps({"remat": remat, "temp_mib": round(c.memory_analysis().temp_size_in_bytes / 2**20, 1),
                      "matmuls": lowered.as_text().count("dot_general"), "barriers_lowered": lowered.as_text().count("optimization_barrier"),
                      "step_s_min": round(min(times), 3), "step_s_median": round(sorted(times)[2], 3)}), flush=True)
