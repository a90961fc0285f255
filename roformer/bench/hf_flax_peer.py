"""transformers 4.x FlaxRoFormerForMaskedLM train step, served to `python -m roformer.bench hf`.

Run as a script by another Python environment (transformers < 5, which still ships the
Flax models, with jax, flax and optax), so it imports nothing from this project. It
speaks JSON lines (`serve`, also used by hf_torch_peer.py): it reads one request (HF
config, batch file, AdamW settings), builds and compiles the step, answers
{"ready": true, "versions": ...} or {"error": ...}; then each "step" line runs one
optimizer step to completion and answers "ok", and "quit" ends it. The step is the one
transformers' run_mlm_flax.py example trains with: logits at every position,
cross-entropy at the masked ones (labels -100 elsewhere), dropout from a per-step key;
AdamW with global-norm clipping and no weight decay on biases and LayerNorm scales, as in
our step.
"""
import json
import os
import sys


def serve(build) -> int:
    """The peer side of the protocol. `build(request)` returns (step, versions), where step()
    runs one optimizer step to completion, or raises ImportError when the peer cannot run
    in this Python."""
    # Protocol replies go to the original stdout; anything a library prints goes to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(message) -> None:
        channel.write((message if isinstance(message, str) else json.dumps(message)) + "\n")

    request = json.loads(sys.stdin.readline())
    try:
        step, versions = build(request)
    except ImportError as error:
        version = sys.modules.get("transformers")
        reply({"error": f"{type(error).__name__}: {error}"
                        + (f" (transformers {version.__version__})" if version else "")})
        return 0
    reply({"ready": True, "versions": {**versions, "python": sys.executable}})
    while sys.stdin.readline().strip() not in ("quit", ""):
        step()
        reply("ok")
    return 0


def build_flax_step(request):
    # imported here: serve() turns an ImportError (no Flax models in this transformers) into its
    # error reply, and what the libraries print on import goes to stderr once serve() redirected it
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from transformers import FlaxRoFormerForMaskedLM, RoFormerConfig

    model = FlaxRoFormerForMaskedLM(RoFormerConfig(**request["hf_config"]), seed=0, dtype=jnp.float32)
    arrays = np.load(request["batch_file"])
    input_ids = jnp.asarray(arrays["input_ids"], jnp.int32)
    labels = jnp.full(input_ids.shape, -100, jnp.int32)
    labels = labels.at[np.arange(input_ids.shape[0])[:, None], arrays["masked_positions"]].set(
        jnp.asarray(arrays["masked_labels"], jnp.int32))
    token_type_ids = jnp.asarray(arrays["token_type_ids"], jnp.int32)
    attention_mask = jnp.ones_like(input_ids)

    opt = request["optimizer"]
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, opt["learning_rate"], opt["warmup_steps"]),
         optax.linear_schedule(opt["learning_rate"], 0.0, opt["total_steps"] - opt["warmup_steps"])],
        [opt["warmup_steps"]])
    tx = optax.chain(optax.clip_by_global_norm(opt["clip_norm"]),
                     optax.adamw(schedule, b1=opt["b1"], b2=opt["b2"], eps=opt["eps"],
                                 weight_decay=opt["weight_decay"],
                                 mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)))
    base_key = jax.random.key(0)

    def loss_fn(params, dropout_rng):
        logits = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                       params=params, dropout_rng=dropout_rng, train=True)[0]
        mask = (labels >= 0).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
        return jnp.sum(losses * mask) / jnp.sum(mask)

    def train_step(state):
        params, opt_state, step = state
        grads = jax.grad(loss_fn)(params, jax.random.fold_in(base_key, step))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, step + 1

    state = (model.params, tx.init(model.params), jnp.zeros((), jnp.int32))
    step_fn = jax.jit(train_step, donate_argnums=0).lower(state).compile()

    def step():
        nonlocal state
        state = jax.block_until_ready(step_fn(state))

    return step, {"transformers": transformers.__version__, "flax": flax.__version__,
                  "jax": jax.__version__, "optax": optax.__version__}


if __name__ == "__main__":
    sys.exit(serve(build_flax_step))
