"""Research throughput: tokens/s of the whole machine when it trains several small runs.

The research loop is many small runs (the reference comparison, the onset study), and at
their size a train step leaves cores idle: much of it is per-op overhead and products
too small to split well over threads. Per shape (size / sequence length / batch, default
tiny/128/16, the reference run's, and mini/128/32), the train step of that run (no dropout,
an 8,000-word vocabulary, as configs/ablation.py:reference) runs in these modes:

- `one`: one run in one process on every core (how runs went before `config.parallel`);
- `procs`: `--parallel` runs side by side, each in a process of its own with XLA:CPU's
  one-core setting (products on the calling thread, no hand-off to a thread pool), free to run
  on any core (roformer.ablation.parallel: what `python -m roformer.ablate --config.parallel=K`
  does);
- `procs_pinned`: the same, each process also pinned to its own core (`sched_setaffinity`);
- `procs_plain`: the same processes with neither setting (XLA:CPU's defaults);
- `vmap`: `--parallel` seeds of one scheme in one process, parameters, optimizer state and
  batches stacked on a leading axis and the step `jax.vmap`ped (each seed its own
  initialisation and batch).
- `procs_vmap`: both: `--parallel` processes as in `procs`, each holding
  `--seeds-per-process` vmapped seeds. On XLA:CPU a vmapped step's batched products run on
  one core, which costs a one-core process nothing, while its per-op overhead is shared by
  the seeds.

Every mode's processes are started once, compiled and warmed up, then the modes run in
alternating rounds (the order rotating), each round `--steps` steps of every run of the
mode at once; a mode's tokens/s is all its runs' tokens over the time from the start of
the round to the end of its last run. `x_one` is the median of the per-round ratios of a
mode's tokens/s to `one`'s (min and max beside it); `cpu_per_wall` is the CPU seconds the
mode's processes used per wall second; `rss_MB_per_run` the peak resident memory of a
process divided by the runs it holds, and on an accelerator `device_MB_per_run` the same for
its peak device memory (jax's allocator statistics). Training only: what starting its own process costs a
run (Python, jax, compiling) is not in these figures. Every mode's processes stay alive
together, so mind the memory at larger shapes (`--modes` runs fewer).
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

# Nothing here imports jax at module level: the worker process sets its cores and malloc
# first (`python -m roformer.bench.runs --worker`).
from roformer import cli
from roformer import machine
from roformer.ablation import parallel as parallel_runs   # `parallel` here counts runs

MODES = ("one", "procs", "procs_pinned", "procs_plain", "vmap", "procs_vmap")
TABLE_COLUMNS = ("shape", "mode", "runs", "tokens_s", "x_one", "x_one_min", "x_one_max", "runs_per_hour",
                 "cpu_per_wall", "rss_MB_per_run", "device_MB_per_run")


def reference_run() -> dict:
    """What the shapes' runs take from configs/ablation.py:reference: its steps (what a runs/hour
    figure counts), vocabulary size and dropout."""
    from roformer.ablation import plan   # may import jax: here, not at module level (see the imports)

    config = plan.load_config_file("ablation", "reference")
    model = config.pretrain.model
    return {"steps": plan.pretrain_steps(config), "vocab_size": config.pretrain.data.vocab_size,
            "hidden_dropout": model.hidden_dropout, "attention_dropout": model.attention_dropout}


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--shapes", many=True, default=["tiny/128/16", "mini/128/32"],
                   help="size/seq_len/batch of the run")
    command.define("--modes", many=True, default=list(MODES), choices=MODES)
    command.define("--parallel", type=int, default=0,
                   help="runs at once in procs and vmap, processes in procs_vmap (0: one per core)")
    command.define("--seeds-per-process", type=int, default=2, help="vmapped seeds per process in procs_vmap")
    command.define("--scheme", default="rope", help="position scheme of the runs")
    command.define("--rounds", type=int, default=5, help="alternating rounds")
    command.define("--steps", type=int, default=30, help="steps of every run per round")


def parse_shape(text: str) -> tuple[str, int, int]:
    size, seq_len, batch = text.split("/")
    return size, int(seq_len), int(batch)


class Worker:
    """A benchmark process holding `seeds` runs of one shape (stacked and vmapped when > 1),
    warmed up; `go(steps)` starts `steps` steps, `wait()` returns its timing."""

    def __init__(self, shape: str, scheme: str, seeds: int, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "roformer.bench.runs", "--worker", shape, scheme, str(seeds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.seeds = seeds

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def ready(self) -> dict:
        return self._read()

    def go(self, steps: int) -> None:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()

    def wait(self) -> dict:
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def start_mode(mode: str, shape: str, scheme: str, parallel: int, seeds_per_process: int = 2) -> list[Worker]:
    if mode == "one":
        return [Worker(shape, scheme, 1, parallel_runs.child_env(None))]
    if mode == "vmap":
        return [Worker(shape, scheme, parallel, parallel_runs.child_env(None))]
    slots = parallel_runs.core_slots(parallel)
    if mode == "procs_plain":
        return [Worker(shape, scheme, 1, parallel_runs.child_env(None)) for _ in slots]
    if mode == "procs_vmap":
        return [Worker(shape, scheme, seeds_per_process, parallel_runs.child_env(cores)) for cores in slots]
    return [Worker(shape, scheme, 1, parallel_runs.child_env(cores, pin=mode == "procs_pinned")) for cores in slots]


def run_round(workers: list[Worker], steps: int) -> tuple[float, float]:
    """Wall seconds until every worker has done `steps` steps (started together), and the
    CPU seconds they used."""
    start = time.perf_counter()
    for worker in workers:
        worker.go(steps)
    results = [worker.wait() for worker in workers]
    return time.perf_counter() - start, sum(r["cpu_s"] for r in results)


def bench_shape(shape: str, args: SimpleNamespace) -> list[dict]:
    from roformer.bench.common import ratio_stats   # imports jax: see the note at the imports

    steps_per_run = reference_run()["steps"]
    size, seq_len, batch = parse_shape(shape)
    parallel = args.parallel or machine.cores_available()
    modes = {mode: start_mode(mode, shape, args.scheme, parallel, args.seeds_per_process) for mode in args.modes}
    try:
        start, ready = time.perf_counter(), {}
        for mode, workers in modes.items():
            ready[mode] = [w.ready() for w in workers]
            # Progress on stderr: where a slow start (compiling) goes, if a time limit ends the run.
            print(f"runs {shape} {mode}: ready {time.perf_counter() - start:.0f} s after the start",
                  file=sys.stderr, flush=True)
        names = list(modes)
        seconds = {m: [] for m in names}
        cpu = {m: [] for m in names}
        for index in range(args.rounds):
            shift = index % len(names)
            for mode in names[shift:] + names[:shift]:
                wall, used = run_round(modes[mode], args.steps)
                seconds[mode].append(wall)
                cpu[mode].append(used / wall)
    finally:
        for workers in modes.values():
            for worker in workers:
                worker.close()
    rows = []
    tokens_per_step = seq_len * batch
    for mode in names:
        runs = sum(w.seeds for w in modes[mode])
        rates = [runs * args.steps * tokens_per_step / s for s in seconds[mode]]
        row = {"shape": shape, "mode": mode, "runs": runs, "tokens_s": statistics.median(rates),
               "runs_per_hour": statistics.median(rates) * 3600 / (steps_per_run * tokens_per_step),
               "cpu_per_wall": statistics.median(cpu[mode]),
               "rss_MB_per_run": per_run(ready[mode], modes[mode], "rss_MB")}
        if all(r.get("device_MB") is not None for r in ready[mode]):
            row["device_MB_per_run"] = per_run(ready[mode], modes[mode], "device_MB")
        if "one" in seconds:
            # Ratio of throughputs = ratio of (runs / time): per round, against one's round.
            one_rates = [tokens_per_step * args.steps / s for s in seconds["one"]]
            stats = ratio_stats(rates, one_rates)
            row.update(x_one=stats["median"], x_one_min=stats["min"], x_one_max=stats["max"])
        rows.append(row)
    return rows


def per_run(ready: list[dict], workers: list[Worker], key: str) -> float:
    """The largest of a mode's processes' `key` figure (at ready) over the runs it holds."""
    return max(r[key] / w.seeds for r, w in zip(ready, workers))


def run(args: SimpleNamespace) -> dict:
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args)
    notes = [f"runs_per_hour counts {reference_run()['steps']} training steps per run (configs/ablation.py:reference), "
             "not its evaluation, extrapolation or GLUE stages",
             f"cores available: {sorted(machine.available_cores())}; the load average is in the JSON's "
             "machine: on a shared machine, other processes take their share of the cores in every mode"]
    return {"rows": rows, "columns": TABLE_COLUMNS, "notes": notes,
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}


# --------------------------------------------------------------------------- worker process


def _worker(shape: str, scheme: str, seeds: int) -> None:
    """Build the step (and `seeds` stacked states when > 1), warm up, say ready with the peak
    RSS, then run the number of steps read from stdin until it closes."""
    # imported here, after enter_slot() and retain_host_memory(): see the note at the imports
    from roformer.host_memory import retain_host_memory

    parallel_runs.enter_slot()   # its cores and thread settings, as a run of the ablation's
    retain_host_memory()   # as the training commands do; before jax runs anything
    import jax
    import jax.numpy as jnp

    from roformer.bench.common import TRAIN_STEP_WARMUP
    from roformer.bench.workload import build_train_workload, synthetic_batch
    from roformer.model import ModelConfig
    from roformer.train import sharding, steps as train_steps

    size, seq_len, batch = parse_shape(shape)
    reference = reference_run()
    config = ModelConfig.from_preset(size, position=scheme, vocab_size=reference["vocab_size"],
                                     hidden_dropout=reference["hidden_dropout"],
                                     attention_dropout=reference["attention_dropout"],
                                     max_position_embeddings=seq_len)
    if seeds == 1:
        step = build_train_workload(config, batch_size=batch, seq_len=seq_len).step
    else:
        from roformer.bench.workload import train_config   # as the imports above: after the slot is set
        from roformer.train import optim
        from roformer.train.state import TrainSetup

        tx, schedule = optim.make_optimizer(**train_config())
        mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
        setup = TrainSetup(config, tx, schedule, mesh)
        # Each seed its own initialisation, batch and dropout key, stacked on a leading axis: the
        # step `python -m roformer.ablate --config.vmap_seeds=K` trains (roformer.train.seeds).
        holder = {"state": setup.init_states(range(seeds))}
        batches = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]),
                               *[synthetic_batch(config, batch, seq_len, seed=k) for k in range(seeds)])
        keys = jnp.stack([train_steps.dropout_base_key(k) for k in range(seeds)])
        vmapped = setup.jit_seeds_train_step()
        with jax.set_mesh(mesh):
            rest = setup.init_rest()

        def step():
            holder["state"], metrics = vmapped(holder["state"], rest, batches, keys)
            return holder["state"], metrics
    for _ in range(TRAIN_STEP_WARMUP):
        jax.block_until_ready(step())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    # An accelerator's own memory (None on CPU, where the RSS above holds everything).
    device_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    print(json.dumps({"ready": True, "rss_MB": rss,
                      "device_MB": None if device_peak is None else device_peak / 2**20}), flush=True)
    for line in sys.stdin:
        count = int(line)
        cpu0 = time.process_time()
        start = time.perf_counter()
        for _ in range(count):
            jax.block_until_ready(step())
        print(json.dumps({"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu0}),
              flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
