"""hf: our jitted train step vs the train steps a user would pick instead, per shape.

Peers, each with the same model configuration (HF RoFormerConfig built from ours:
vocabulary, sizes, dropout, gelu, rotary on q/k), the same synthetic batch with 15% of
positions masked, AdamW with our hyper-parameters and global-norm clipping, and dropout
as each ships:
  hf_torch          transformers' PyTorch RoFormerForMaskedLM, eager, on all cores, or on the
                    GPU when jax runs on one (fused AdamW; bf16 autocast with --dtype bfloat16)
  hf_torch_compile  the same under torch.compile (--torch-compile-backend, inductor by
                    default), the clipping + AdamW update compiled as well
  hf_torch_compile_masked_head
                    the same, with the model's MLM head applied at the masked positions only
                    (the encoder's output gathered there, then its own `cls` head and cross
                    entropy): the matmul work ours does, so its ratio is ours against the same
                    work. Not in the default --peers (not what a user runs; it is the control
                    that says how much of the lead is the sparse head)
  hf_flax           transformers 4.x FlaxRoFormerForMaskedLM, the JAX port removed in
                    transformers 5, jitted as in its run_mlm_flax.py example; it runs in a
                    subprocess of the Python given by --flax-python (default: the
                    ROFORMER_BENCH_FLAX_PYTHON environment variable, else this one), e.g.
                    a venv with `pip install 'transformers<5' flax jax optax`
Every peer runs in a process of its own, as it ships: the PyTorch ones in another process of
this Python (hf_torch_peer.py; --torch-process this keeps them in this process, where they
run with the malloc settings our commands make on CPU, roformer.host_memory), the Flax port
in the Python given by --flax-python.
The stock peers compute logits at every position and take the loss at the masked ones
(labels -100 elsewhere); ours computes logits only at the masked positions, which is part
of what is compared: each peer row's work_x is its matmul FLOPs per step over ours
(roformer.train.flops, with the head at every position or at the masked ones), so
ours_x / work_x is the ratio per unit of matmul work. A peer that cannot run (not
installed, import or compile failure) is listed under "peers" with the reason and printed
as a note ("hf_flax not run at SHAPE: why"); the others are still measured. This benchmark
is also the check of the Flax port peer, which the test suite cannot run (it needs a Python
with transformers < 5):
  python -m roformer.bench hf --shapes tiny/16/2 --peers hf_flax --rounds 1 --iters 1 \
      --flax-python ../venv-tf4/bin/python

Each shape (size/seq/batch) times ours and every available peer in >= 5 alternating rounds.
Per peer: ours_x = peer step time / our step time (= our tokens/s over theirs), the median of
the per-round ratios with min and max. Ours also gets MFU, from its own alternating rounds with
a square matmul of --dtype (as in `step`), not from the peers' rounds: against the accelerator's
table peak (roformer.train.flops.PEAK_FLOPS), as every MFU of the project; on a CPU, or an
accelerator the table lacks, against that matmul (`matmul_GFLOP_s` gives it in both cases).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from roformer import cli
from roformer.bench.common import TRAIN_STEP_WARMUP, alternate, ratio_stats
from roformer.bench.step import default_peak_size, step_figures, time_with_matmul, vendor_peak
from roformer.bench.workload import build_train_workload, num_predictions, synthetic_batch, train_config
from roformer.model import PRESETS, ModelConfig, backend
from roformer.model.attention import ATTENTION_IMPLEMENTATIONS
from roformer.train.flops import train_flops_per_step

PEERS = ("hf_torch", "hf_torch_compile", "hf_flax", "hf_torch_compile_masked_head")
DEFAULT_PEERS = PEERS[:3]
MASKED_HEAD_PEERS = ("hf_torch_compile_masked_head",)
FLAX_PYTHON_ENV = "ROFORMER_BENCH_FLAX_PYTHON"
TABLE_COLUMNS = ("shape", "impl", "ms_step", "tokens_s", "ours_x", "ours_x_min", "ours_x_max", "work_x",
                 "mfu", "mfu_min", "mfu_max", "mfu_best_peak")


def shape_arg(text: str) -> tuple[str, int, int]:
    """'mini/128/32' -> ('mini', 128, 32): model size preset / sequence length / batch."""
    parts = text.split("/")
    if len(parts) != 3 or parts[0] not in PRESETS or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        raise ValueError(f"expected SIZE/SEQ/BATCH with SIZE in {list(PRESETS)}, got {text!r}")
    return parts[0], int(parts[1]), int(parts[2])


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--shapes", type=shape_arg, many=True,
                   default=[shape_arg(s) for s in ("mini/128/32", "small/128/32", "mini/512/8")],
                   help="SIZE/SEQ/BATCH of each comparison (default: mini/128/32,small/128/32,"
                        "mini/512/8; the last keeps 4,096 tokens per step)")
    command.define("--peers", many=True, default=list(DEFAULT_PEERS), choices=PEERS,
                   help=f"default: {','.join(DEFAULT_PEERS)}")
    command.define("--flax-python", default=os.environ.get(FLAX_PYTHON_ENV) or sys.executable,
                   help=f"Python with transformers<5, flax, jax, optax for hf_flax (default: "
                        f"${FLAX_PYTHON_ENV}, else this interpreter)")
    command.define("--torch-compile-backend", default="inductor",
                   help="torch.compile backend of hf_torch_compile (inductor; aot_eager compiles fast)")
    command.define("--vocab-size", type=int, default=30522)
    command.define("--attention-impl", default="auto", choices=ATTENTION_IMPLEMENTATIONS)
    command.define("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="our compute dtype; bfloat16 runs the PyTorch peers under bf16 autocast")
    command.define("--attention-dropout", type=float, default=None,
                   help="attention dropout of every model (default: ModelConfig's)")
    command.define("--dropout-rng-impl", default="threefry2x32", choices=("threefry2x32", "rbg"),
                   help="our dropout keys' implementation (train.dropout_rng_impl); the peers draw torch's")
    command.define("--torch-device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the PyTorch peers run (auto: the GPU when jax runs on one, with fused AdamW)")
    command.define("--peak-size", type=int, default=0, help="matmul side for the MFU peak (0: auto)")
    command.define("--rounds", type=int, default=5)
    command.define("--iters", type=int, default=2)
    command.define("--torch-threads", type=int, default=0, help="0: torch's default (all cores)")
    command.define("--torch-process", choices=("own", "this"), default="own",
                   help="run the PyTorch peers in a process of their own, as they ship (own), or in "
                        "this one, with the malloc settings of roformer.host_memory (this)")


def hf_config_dict(config: ModelConfig) -> dict:
    """RoFormerConfig arguments describing our model (both transformers 4 and 5 take them)."""
    return dict(
        vocab_size=config.vocab_size, embedding_size=config.embedding_size or config.hidden_size,
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act, hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
        initializer_range=config.initializer_range, layer_norm_eps=config.layer_norm_eps,
        pad_token_id=config.pad_token_id, rotary_value=config.rotary_value)


def hf_config(config: ModelConfig):
    from transformers import RoFormerConfig   # imported here: heavy and optional (the dev extra)

    return RoFormerConfig(**hf_config_dict(config))


def torch_train_step(config: ModelConfig, batch: dict[str, np.ndarray], compile_backend: str | None = None,
                     device: str = "cpu", masked_head: bool = False):
    """A closure running one PyTorch AdamW step of HF RoFormerForMaskedLM on `batch`: eager,
    or with the model and the clip + AdamW update under torch.compile(backend=compile_backend).
    `masked_head`: the model's MLM head (`cls`) and loss at the masked positions only, on the
    encoder's output gathered there, instead of the model's forward with labels.
    On a GPU (`device="cuda"`) with fused AdamW, as a user there would run it; a config with
    dtype bfloat16 runs under bf16 autocast (float32 parameters, as ours). The step returns
    once its work has finished, with its loss (a tensor). A compiled step has run once when it
    is returned, so a compiler failure raises here."""
    # imported here: torch and transformers are heavy and optional (the dev extra)
    import torch
    from transformers import RoFormerForMaskedLM as HFRoFormerForMaskedLM

    torch.manual_seed(0)
    device = torch.device(device)
    model = HFRoFormerForMaskedLM(hf_config(config)).train().to(device)
    tc = train_config()
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc["learning_rate"], betas=(tc["b1"], tc["b2"]),
                                  eps=tc["eps"], weight_decay=tc["weight_decay"], fused=device.type == "cuda")
    input_ids = torch.from_numpy(batch["input_ids"]).long()
    # the loss's targets: the real prediction slots (weight > 0), -100 (ignored) elsewhere
    targets = torch.from_numpy(np.where(batch["masked_weights"] > 0, batch["masked_labels"], -100)).long()
    labels = torch.full_like(input_ids, -100)
    labels[np.arange(input_ids.shape[0])[:, None], batch["masked_positions"]] = targets
    inputs = {"input_ids": input_ids, "token_type_ids": torch.from_numpy(batch["token_type_ids"]).long(),
              "attention_mask": torch.ones_like(input_ids), "labels": labels}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    autocast = config.dtype == "bfloat16"
    positions = torch.from_numpy(batch["masked_positions"]).long().to(device)
    targets = targets.to(device)
    rows = torch.arange(input_ids.shape[0], device=device)[:, None]

    def model_loss(input_ids, token_type_ids, attention_mask, labels):
        if not masked_head:
            return model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                         labels=labels).loss
        hidden = model.roformer(input_ids=input_ids, token_type_ids=token_type_ids,
                                attention_mask=attention_mask).last_hidden_state
        logits = model.cls(hidden[rows, positions])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc["clip_norm"])
        optimizer.step()

    forward = model_loss
    if compile_backend is not None:
        forward = torch.compile(model_loss, backend=compile_backend)
        update = torch.compile(update, backend=compile_backend)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(**inputs)
        loss.backward()
        update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return loss.detach()

    if compile_backend is not None:
        step()
    return step


class ChildPeer:
    """A peer's train step in a process of its own (hf_flax_peer.py's JSON-lines protocol):
    `command` starts it, `request` builds the step there. Calling the peer runs one step there
    and returns when it has finished (one pipe round trip, well under a millisecond, is timed
    with it). Raises RuntimeError if it cannot start or build."""

    def __init__(self, command: list[str], request: dict):
        self._stderr = tempfile.TemporaryFile("w+")
        try:
            self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._stderr, text=True)
        except OSError as error:
            self.close()
            raise RuntimeError(f"cannot start {command[0]}: {error}") from error
        answer = self._ask(json.dumps(request))
        if "error" in answer:
            self.close()
            raise RuntimeError(f"{command[0]}: {answer['error']}")
        self.versions = answer["versions"]

    def _ask(self, line: str) -> dict:
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass
        answer = self._proc.stdout.readline()
        if not answer:
            self._proc.wait()
            self._stderr.seek(0)
            tail = self._stderr.read()[-1500:].strip()
            return {"error": f"exited with code {self._proc.returncode}: {tail}"}
        return {"ok": True} if answer.strip() == "ok" else json.loads(answer)

    def __call__(self) -> None:
        answer = self._ask("step")
        if "error" in answer:
            raise RuntimeError(f"peer step failed: {answer['error']}")

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write("quit\n")
                proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._stderr.close()


def flax_port_peer(python: str, config: ModelConfig, batch: dict[str, np.ndarray]) -> ChildPeer:
    """transformers 4.x FlaxRoFormerForMaskedLM's train step, run by `python` (hf_flax_peer.py)."""
    with tempfile.TemporaryDirectory(prefix="roformer-bench-hf-flax-") as scratch:
        batch_file = Path(scratch) / "batch.npz"
        np.savez(batch_file, **batch)
        request = {"hf_config": hf_config_dict(config), "batch_file": str(batch_file),
                   "optimizer": dict(train_config())}
        # the peer has read the batch once it answers
        return ChildPeer([python, str(Path(__file__).with_name("hf_flax_peer.py"))], request)


def torch_process_peer(config: ModelConfig, seq_len: int, batch_size: int, args: SimpleNamespace,
                       compile_backend: str | None = None, masked_head: bool = False) -> ChildPeer:
    """HF PyTorch's train step (eager, or under torch.compile) in its own process of this Python
    (hf_torch_peer.py), as it ships: without this process's malloc settings."""
    request = {"config": config.to_dict(), "seq_len": seq_len, "batch": batch_size,
               "compile_backend": compile_backend, "torch_threads": args.torch_threads,
               "device": torch_device(args), "masked_head": masked_head}
    return ChildPeer([sys.executable, "-m", "roformer.bench.hf_torch_peer"], request)


def build_peers(names, config: ModelConfig, seq_len: int, batch_size: int, args: SimpleNamespace):
    """name -> step callable for every peer that could be built, name -> reason for the
    others, and the closers of the peers' processes."""
    batch = synthetic_batch(config, batch_size, seq_len)
    steps, unavailable, closers = {}, {}, []
    for name in names:
        try:
            if name == "hf_flax":
                steps[name] = flax_port_peer(args.flax_python, config, batch)
            else:
                backend = args.torch_compile_backend if name.startswith("hf_torch_compile") else None
                masked_head = name in MASKED_HEAD_PEERS
                if args.torch_process == "own":
                    steps[name] = torch_process_peer(config, seq_len, batch_size, args, compile_backend=backend,
                                                     masked_head=masked_head)
                else:
                    steps[name] = torch_train_step(config, batch, compile_backend=backend,
                                                   device=torch_device(args), masked_head=masked_head)
            if isinstance(steps[name], ChildPeer):
                closers.append(steps[name].close)
        except Exception as error:  # noqa: BLE001 - a peer that fails to build is reported, not fatal
            unavailable[name] = f"{type(error).__name__}: {error}"
    return steps, unavailable, closers


def torch_device(args: SimpleNamespace) -> str:
    """Where the PyTorch peers run: --torch-device, or for auto the GPU when jax runs on one."""
    if args.torch_device != "auto":
        return args.torch_device
    import jax

    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def bench_shape(size: str, seq_len: int, batch_size: int, args: SimpleNamespace):
    """Rows (ours first, then each measured peer) and comparisons of one shape, and the
    peers that could not run with the reason."""
    dropout = {} if args.attention_dropout is None else {"attention_dropout": args.attention_dropout}
    config = ModelConfig.from_preset(size, vocab_size=args.vocab_size, max_position_embeddings=max(512, seq_len),
                                     dtype=args.dtype, **dropout)
    shape = f"{size}/{seq_len}/{batch_size}"
    ours = build_train_workload(config, batch_size=batch_size, seq_len=seq_len, attention_impl=args.attention_impl,
                                dropout_rng_impl=args.dropout_rng_impl)
    peers, unavailable, closers = build_peers(args.peers, config, seq_len, batch_size, args)
    try:
        # (the warm-up also covers torch.compile and AdamW's lazy state recompiling on the 2nd call)
        times = alternate({"ours_jax": ours.step, **peers}, rounds=args.rounds, iters=args.iters,
                          warmup=TRAIN_STEP_WARMUP)
    finally:
        for close in closers:
            close()
    # MFU from rounds of ours and the matmul alone: timed among the peers' steps the matmul
    # ran slow on a 2-core CPU and MFU came out above 1.
    mfu_times, peaks = time_with_matmul({"ours_jax": ours.step}, dtype=args.dtype,
                                        peak_size=args.peak_size or default_peak_size(),
                                        rounds=args.rounds, iters=args.iters)
    tokens = batch_size * seq_len
    step_s = statistics.median(times["ours_jax"])
    # the step time and rate the peers are compared with come from the peers' rounds
    rows = [{"shape": shape, "impl": "ours_jax", **step_figures(ours, mfu_times["ours_jax"], peaks,
                                                                  vendor_peak(args.dtype)),
             "ms_step": step_s * 1e3, "tokens_s": tokens / step_s, "GFLOP_s": ours.flops_per_step / step_s / 1e9}]
    comparisons = []
    for name in peers:
        stats = ratio_stats(times[name], times["ours_jax"])
        step_s = statistics.median(times[name])
        rows.append({"shape": shape, "impl": name, "ms_step": step_s * 1e3, "tokens_s": tokens / step_s,
                     "ours_x": stats["median"], "ours_x_min": stats["min"], "ours_x_max": stats["max"],
                     "work_x": peer_flops(name, config, seq_len, batch_size) / ours.flops_per_step})
        comparisons.append({"name": f"ours / {name} tokens/s [{shape}]", "rounds": args.rounds, **stats})
    versions = {name: peer.versions for name, peer in peers.items() if isinstance(peer, ChildPeer)}
    return rows, comparisons, unavailable, versions


def peer_flops(name: str, config: ModelConfig, seq_len: int, batch_size: int) -> float:
    """A peer's matmul FLOPs per step, counted as ours are: its MLM head at every position
    (at the masked slots for a masked-head peer)."""
    predictions = num_predictions(seq_len) if name in MASKED_HEAD_PEERS else seq_len
    return train_flops_per_step(config, batch_size=batch_size, seq_len=seq_len, num_predictions=predictions)


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args: SimpleNamespace) -> dict:
    versions = {"torch": installed_version("torch"), "transformers": installed_version("transformers")}
    if args.torch_process == "this" and any(name.startswith("hf_torch") for name in args.peers) and versions["torch"]:
        import torch   # imported here: heavy and optional (the dev extra)

        if args.torch_threads > 0:
            torch.set_num_threads(args.torch_threads)
        versions["torch_threads"] = torch.get_num_threads()
    rows, comparisons, notes = [], [], []
    peers = {name: {"measured": [], "not_available": {}} for name in args.peers}
    for size, seq_len, batch_size in args.shapes:
        shape_rows, shape_comparisons, unavailable, peer_versions = bench_shape(size, seq_len, batch_size, args)
        rows += shape_rows
        comparisons += shape_comparisons
        versions.update(peer_versions)
        shape = shape_rows[0]["shape"]
        for name in args.peers:
            if name in unavailable:
                peers[name]["not_available"][shape] = unavailable[name]
                notes.append(f"{name} not run at {shape}: {unavailable[name]}")
            else:
                peers[name]["measured"].append(shape)
    return {"rows": rows, "columns": TABLE_COLUMNS, "comparisons": comparisons, "notes": notes,
            "peers": peers, "versions": versions, "backend_forms": sorted(backend.active_forms()),
            "settings": {k: (["/".join(map(str, s)) for s in v] if k == "shapes" else v)
                         for k, v in vars(args).items() if k != "json"}}
