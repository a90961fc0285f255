"""What checkpoint checksums cost at a model size: one training state (parameters and AdamW's
two moments, non-zero as after a training step) saved as the training loop saves it, then
its checksums written and verified.

    python scripts/checkpoint_integrity_cost.py --size base --dir /tmp/ckcost --repeats 3

Prints one JSON line per repeat (seconds: `save` = orbax save until complete, `checksums` =
writing checksums.json, `verify` = checking it, `restore` = orbax restore) and the median
of each; the step's bytes are in `bytes`.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # the project's package, also when it is not installed

import jax  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

from roformer import checksums, cli  # noqa: E402
from roformer.model import ModelConfig, RoFormerForMaskedLM  # noqa: E402
from roformer.train.checkpoint import Checkpointer  # noqa: E402


@cli.entry_point
def main() -> None:
    command = cli.CommandFlags(__doc__)
    command.define("--size", default="base")
    command.define("--vocab-size", type=int, default=30522)
    command.define("--dir", required=True, help="scratch directory (removed and made again)")
    command.define("--repeats", type=int, default=3)
    args, positional = command.parse(sys.argv[1:])
    if positional:
        raise cli.UsageError(f"unexpected arguments: {positional}")
    config = ModelConfig.from_preset(args.size, vocab_size=args.vocab_size)
    params = nnx.to_pure_dict(nnx.state(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param))
    # AdamW's moments start at zero, which orbax's compressed storage shrinks to nothing: give them
    # values, as after any training step, so the step holds three models' worth of floats.
    opt_state = optax.adamw(1e-4).init(params)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(opt_state))))
    opt_state = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype) * 1e-3
                             if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, opt_state)
    state = {"params": params, "opt_state": opt_state, "step": jax.numpy.int32(1)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    rows = []
    for repeat in range(args.repeats):
        directory = Path(args.dir)
        shutil.rmtree(directory, ignore_errors=True)
        checkpointer = Checkpointer(directory / "checkpoints", max_to_keep=1)
        step_dir = directory / "checkpoints" / "1"
        start = time.perf_counter()
        checkpointer.save(1, state, {}, config.to_dict())
        checkpointer.wait()
        saved = time.perf_counter()
        if not (step_dir / checksums.CHECKSUMS).is_file():   # a Checkpointer that does not write them itself
            checksums.write(step_dir)
        sealed = time.perf_counter()
        (step_dir / checksums.CHECKSUMS).unlink()
        start_write = time.perf_counter()
        checksums.write(step_dir)
        written = time.perf_counter()
        assert checksums.verify(step_dir)
        verified = time.perf_counter()
        restored = checkpointer.manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        jax.block_until_ready(restored["state"])
        done = time.perf_counter()
        checkpointer.close()
        size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
        row = {"repeat": repeat, "bytes": size, "save": round(saved - start, 3),
               "save_and_checksums": round(sealed - start, 3), "checksums": round(written - start_write, 3),
               "verify": round(verified - written, 3), "restore": round(done - verified, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"median": {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "repeat"}}))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
