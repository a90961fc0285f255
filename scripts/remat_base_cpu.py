"""docs/results/2026-12-07-remat.md, CPU tables: `python scripts/remat_base_cpu.py 4 512 mem [SIZE]`.

XLA's buffer assignment (memory_analysis) of the compiled SIZE (default base) train step at
BATCH x LENGTH with model.remat none|full|dots on this CPU, and with `time` the step time of
each (2 steps after an untimed one)."""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from roformer.model import ModelConfig, RoFormerForMaskedLM

batch, length, timed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "time"
size = sys.argv[4] if len(sys.argv) > 4 else "base"
for remat in ("none", "full", "dots"):
    config = ModelConfig.from_preset(size, remat=remat)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, config.vocab_size, (batch, length)), jnp.int32)

    @nnx.jit
    def step(model, optimizer, ids):
        def loss_fn(model):
            logits = model(ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    t0 = time.perf_counter()
    mem = step.lower(model, optimizer, ids).compile().memory_analysis()
    out = {"size": size, "remat": remat, "batch": batch, "length": length, "compile_s": round(time.perf_counter() - t0, 1),
           "temp_gib": round(mem.temp_size_in_bytes / 2**30, 3),
           "argument_gib": round(mem.argument_size_in_bytes / 2**30, 3),
           "output_gib": round(mem.output_size_in_bytes / 2**30, 3),
           "jax": jax.__version__, "cpu_count": jax.devices()[0].device_kind}
    if timed:
        jax.block_until_ready(step(model, optimizer, ids))
        times = []
        for _ in range(2):
            t = time.perf_counter()
            jax.block_until_ready(step(model, optimizer, ids))
            times.append(time.perf_counter() - t)
        out["step_s"] = [round(t, 2) for t in times]
    print(json.dumps(out), flush=True)
