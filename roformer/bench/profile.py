"""Where one train step's time goes: the jax profiler's per-op times, grouped by kind.

Traces a few steps of the `step` benchmark's workload (one size, length, batch and scheme),
matches every traced op to its instruction in the compiled program, and sums the time by
kind: matmul (a fusion or op containing a dot or convolution), layout copy (a fusion whose
result is a transpose or copy), reduction, random bits (dropout masks) and the remaining
elementwise work. A second table lists the most expensive ops with the jax operation each
comes from, and for those with dots the GFLOP/s their traced time implies; a note names the
matmul ops traced faster than a large square matmul runs, which return before their
product is done (their time lands in the ops traced meanwhile). XLA:CPU runs independent
ops of a step at the same time on different threads now and then, so the kinds add up to
more than the time any op was running; the notes give
both (`busy_ms`: the union of the ops' intervals, `concurrent_ms`: time with two or more
ops running). The untraced steps also report the process's minor page faults and system /
user CPU time per step (getrusage): time the kernel spends faulting in buffers shows up
inside the ops. A third table times the step's matmul shapes alone, with the CPU time they
take per wall-clock second (2 = both cores of a 2-core machine busy): it shows which
products run below the rate of a large square matmul, and whether they use every core.
"""
from __future__ import annotations

import collections
import gzip
import json
import math
import re
import resource
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from roformer import cli
from roformer.bench import step as step_bench
from roformer.bench.common import TRAIN_STEP_WARMUP, failure, time_call, warm_up
from roformer.bench.gpu_cost import operand_names
from roformer.bench.workload import build_train_workload, num_predictions
from roformer.machine import matmul_probe
from roformer.model import PRESETS
from roformer.model.attention import ATTENTION_IMPLEMENTATIONS
from roformer.model.positions import POSITION_SCHEMES

KINDS = ("matmul", "layout copy", "reduction", "random bits", "elementwise and other")
PROBE_ROW = "2,048^2 matmul"
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+) .*\{\s*$")
_RANDOM = ("random_bits", "_bernoulli", "threefry", "rng_bit_generator", "_uniform")


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--size", default="mini", choices=list(PRESETS))
    command.define("--seq-len", type=int, default=128)
    command.define("--batch", type=int, default=32, help="sequences per step")
    command.define("--scheme", default="rope", choices=sorted(POSITION_SCHEMES))
    command.define("--dtype", default="float32", choices=["float32", "bfloat16"])
    command.define("--vocab-size", type=int, default=30522)
    command.define("--attention-dropout", type=float, default=None,
                   help="override attention dropout (default: the model config's 0.1)")
    command.define("--hidden-dropout", type=float, default=None,
                   help="override hidden dropout (default: the model config's 0.1)")
    command.define("--attention-impl", default="auto", choices=ATTENTION_IMPLEMENTATIONS,
                   help="jax.nn.dot_product_attention implementation (cudnn: the fused kernel on a GPU, "
                        "with --attention-dropout 0)")
    command.define("--steps", type=int, default=3, help="traced steps (after 3 untraced)")
    command.define("--top", type=int, default=25, help="rows of the most expensive ops")
    command.define("--trace-dir", type=Path, default=None,
                   help="keep the trace here (TensorBoard/Perfetto); default: a temporary directory")
    command.define("--from-trace", type=Path, default=None,
                   help="read a trace kept with --trace-dir (e.g. copied from a GPU machine) "
                        "instead of tracing: its train_step.hlo.txt and newest *.trace.json.gz, "
                        "--steps traced steps; prints the kinds and the most expensive ops")


def _dims(shape: str) -> list[int]:
    """[640, 30522] from an array shape such as 'f32[640,30522]{1,0}' ([] for scalars, tuples)."""
    match = re.match(r"^[a-z0-9]+\[([\d,]*)\]", shape)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


_ELEMENT_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                  "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8,
                  "c128": 16}


def _bytes(shape: str) -> int:
    """Bytes of an array shape, or of every array in a tuple shape such as
    '(bf16[128,768]{1,0}, f32[2]{0})' (element types not in the table count 4 bytes)."""
    return sum(_ELEMENT_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]", shape))




def _contraction_flops(result_shape: str, lhs_shape: str, lhs_contracting: str) -> float:
    """2 x result elements x contracted size: `result_shape` the first array of the result
    (a GPU library call returns (result, workspace)), `lhs_contracting` the text listing the
    contracted dimensions of the left operand."""
    result = re.search(r"[a-z][a-z0-9]*\[[\d,]*\]", result_shape)
    lhs_dims = _dims(lhs_shape)
    axes = [int(d) for d in re.findall(r"\d+", lhs_contracting)]
    return 2.0 * math.prod(_dims(result.group(0)) if result else []) * math.prod(
        lhs_dims[a] for a in axes if a < len(lhs_dims))


def _dot_flops(shape: str, rest: str, shapes: dict[str, str]) -> float:
    """FLOPs of one dot instruction."""
    operands = operand_names(rest)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    return _contraction_flops(shape, shapes.get(operands[0], "") if operands else "",
                              contracting.group(1) if contracting else "")


def _library_gemm_flops(shape: str, rest: str, shapes: dict[str, str]) -> float:
    """FLOPs of a GPU library GEMM (a custom-call such as __cublas$gemm or
    __cublas$lt$matmul), from the dot dimension numbers in its backend config."""
    if not re.search(r'custom_call_target="[^"]*(gemm|matmul)', rest):
        return 0.0
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
    operands = operand_names(rest)
    if not (contracting and operands):
        return 0.0
    return _contraction_flops(shape, shapes.get(operands[0], ""), contracting.group(1))


def parse_program(hlo_text: str) -> dict[str, dict]:
    """Instruction name -> {kind, shape, op, flops, bytes} for every instruction of a compiled
    HLO module; flops counts the dots in the instruction (and in what it calls), bytes the
    operands it reads and the result it writes (what a memory-bound op's time is set by)."""
    bodies: dict[str, list[tuple]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = bodies.setdefault(header.group(1), [])
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            current.append((bool(match.group(1)), match.group(2), match.group(3), match.group(4), match.group(5)))

    def contents(computation: str, seen: set) -> set[str]:
        """Opcodes of a computation and of everything it calls."""
        if computation in seen:
            return set()
        seen.add(computation)
        opcodes = set()
        for _, _, _, opcode, rest in bodies.get(computation, ()):
            opcodes.add(opcode)
            for called in re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", rest):
                opcodes |= contents(called, seen)
        return opcodes

    def instruction_flops(instruction: tuple, shapes: dict[str, str], seen: set) -> float:
        """FLOPs of an instruction's own dot and of the dots in the computations it calls."""
        _, _, shape, opcode, rest = instruction
        total = (_dot_flops(shape, rest, shapes) if opcode == "dot"
                 else _library_gemm_flops(shape, rest, shapes) if opcode == "custom-call" else 0.0)
        for called in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", rest):
            if called not in seen:
                seen.add(called)
                callee = bodies.get(called, ())
                callee_shapes = {name: shape for _, name, shape, _, _ in callee}
                total += sum(instruction_flops(inner, callee_shapes, seen) for inner in callee)
        return total

    def root_opcode(computation: str) -> str:
        """The opcode that makes a computation's result, looking through bitcasts and reshapes."""
        by_name = {name: (opcode, rest) for _, name, _, opcode, rest in bodies.get(computation, ())}
        roots = [name for is_root, name, _, _, _ in bodies.get(computation, ()) if is_root]
        name = roots[0] if roots else None
        while name in by_name and by_name[name][0] in ("bitcast", "reshape"):
            operand = re.match(r"%([\w.\-]+)", by_name[name][1])
            name = operand.group(1) if operand else None
        return by_name[name][0] if name in by_name else ""

    program = {}
    for instructions in bodies.values():
        shapes = {name: shape for _, name, shape, _, _ in instructions}
        for instruction in instructions:
            _, name, shape, opcode, rest = instruction
            op_name = re.search(r'op_name="([^"]*)"', rest)
            op_name = op_name.group(1) if op_name else ""
            called = re.search(r"calls=%([\w.\-]+)", rest)
            opcodes = {opcode} | (contents(called.group(1), set()) if called else set())
            root = root_opcode(called.group(1)) if called else opcode
            # cuBLAS GEMMs and cuDNN's fused attention (its two batched products) on a GPU
            library_matmul = "custom-call" in opcodes and re.search(r"gemm|matmul|cublas|fmha", rest)
            if opcodes & {"dot", "convolution"} or library_matmul:
                kind = "matmul"
            elif any(marker in op_name for marker in _RANDOM) or "rng-bit-generator" in opcodes:
                kind = "random bits"
            elif root in ("transpose", "copy"):
                kind = "layout copy"
            elif root == "reduce" or (root == "tuple" and "reduce" in opcodes):
                kind = "reduction"
            else:
                kind = "elementwise and other"
            program[name] = {"kind": kind, "shape": shape, "op": op_name,
                             "flops": instruction_flops(instruction, shapes, set()),
                             "bytes": _bytes(shape) + sum(_bytes(shapes.get(operand, "")) for operand in operand_names(rest))}
    return program


def op_events(trace_dir: Path) -> list[tuple[str, float, float]]:
    """(op name, start, end) in seconds of every complete event in the newest
    *.trace.json.gz under trace_dir.

    On a CPU an op's event is named after its instruction. On a GPU the device's kernel
    events carry the instruction in args.hlo_op and are named after the kernel (a cuBLAS or
    cuDNN kernel's own name, or the fusion's name with '_' for '.'), while the host's
    launch events carry the instruction names too: where any event has args.hlo_op, only
    those count, so that each kernel is counted once, on the device. Kernels that XLA ran
    inside a command buffer (a CUDA graph) all carry that buffer's name instead: they keep
    their kernel's name, which `instruction_of` maps back."""
    return _op_events(_trace_events(trace_dir))


def _trace_events(trace_dir: Path) -> list[dict]:
    """Every event of the newest *.trace.json.gz under trace_dir."""
    traces = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"the jax profiler wrote no *.trace.json.gz under {trace_dir}")
    with gzip.open(traces[-1]) as f:
        return json.load(f)["traceEvents"]


def _on_gpu(trace_events: list[dict]) -> bool:
    """Whether the trace has a GPU's device process (its kernels may run from command buffers)."""
    return any(event.get("ph") == "M" and "/device:GPU" in str(event.get("args", {}).get("name"))
               for event in trace_events)


def _op_events(trace_events: list[dict]) -> list[tuple[str, float, float]]:
    events = [event for event in trace_events if event.get("ph") == "X" and "name" in event]
    device = [event for event in events if isinstance(event.get("args"), dict) and "hlo_op" in event["args"]]

    def name(event: dict) -> str:
        op = event["args"]["hlo_op"] if device else event["name"]
        return event["name"] if device and op.startswith("command_buffer") else op

    return [(name(event), event["ts"] / 1e6, (event["ts"] + event.get("dur", 0)) / 1e6) for event in (device or events)]


def instruction_of(name: str, program: dict[str, dict]) -> str | None:
    """The program's instruction an op event stands for: its own name, a fusion kernel's
    name with its '_N' suffix read as the instruction's '.N', or None (a library kernel
    run from a command buffer, which names no instruction)."""
    if name in program:
        return name
    dotted = re.sub(r"_(\d+)$", r".\1", name)
    return dotted if dotted in program else None


# cuBLAS (nvjet, cutlass, xmma, gemm) and cuDNN (fused attention and its helper kernels)
_LIBRARY_MATMUL = re.compile(r"nvjet|cublas|cutlass|xmma|gemm|cudnn|sdpa|fmha|flash", re.IGNORECASE)


def library_kernel(name: str) -> dict:
    """A program entry for a kernel no instruction is named after (see `instruction_of`):
    cuBLAS GEMMs and cuDNN attention count as matmul, as their custom calls do."""
    return {"kind": "matmul" if _LIBRARY_MATMUL.search(name) else "elementwise and other",
            "shape": "", "op": "library kernel", "flops": 0.0, "bytes": 0}


def attribute(events: list[tuple[str, float, float]], program: dict[str, dict], *,
              library_kernels: bool) -> tuple[dict[str, float], collections.Counter, list[tuple[float, float]]]:
    """Traced seconds and calls per instruction, and the intervals of the events matched.
    Events that name no instruction are dropped, except with `library_kernels` (a GPU's
    command buffers): then each such kernel counts under its own name and gets a `program`
    entry from `library_kernel`."""
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    intervals = []
    for name, start, end in events:
        instruction = instruction_of(name, program)
        if instruction is None and library_kernels:
            instruction = name[:90]
            program.setdefault(instruction, library_kernel(name))
        if instruction is None:
            continue
        seconds[instruction] += end - start
        calls[instruction] += 1
        intervals.append((start, end))
    return seconds, calls, intervals


def step_breakdown(events: list[tuple[str, float, float]], program: dict[str, dict], steps: int, top: int, *,
                   library_kernels: bool) -> dict:
    """Per step: the traced time by kind (`rows`), the `top` most expensive ops, each
    matmul op's GFLOP/s (`rate`), and the traced, busy and concurrent milliseconds."""
    seconds, calls, intervals = attribute(events, program, library_kernels=library_kernels)
    busy, concurrent = busy_and_concurrent(intervals)
    per_kind = dict.fromkeys(KINDS, 0.0)
    ops = []
    for name, total in seconds.items():
        entry = program[name]
        per_kind[entry["kind"]] += total / steps
        ops.append((total / steps, name, entry))
    traced = sum(per_kind.values())
    rows = [{"kind": kind, "ms_step": per_kind[kind] * 1e3, "share": per_kind[kind] / traced if traced else 0.0}
            for kind in KINDS]
    rate = {name: entry["flops"] * calls[name] / seconds[name] / 1e9
            for _, name, entry in ops if entry["flops"] and seconds[name] > 0}
    top_ops = [{"op": name, "kind": entry["kind"], "ms_step": s * 1e3, "calls_step": calls[name] / steps,
                "GFLOP/s": rate.get(name),
                "GB/s": entry["bytes"] * calls[name] / seconds[name] / 1e9 if seconds[name] > 0 and entry["bytes"] else None,
                "shape": entry["shape"][:40], "from": _short_op(entry["op"])[-70:]}
               for s, name, entry in sorted(ops, key=lambda item: item[0], reverse=True)[:top]]
    notes = [f"ops running: {busy / steps * 1e3:.1f} ms per step (union of the traced ops), "
             f"{concurrent / steps * 1e3:.1f} ms of it with two or more at once (counted twice by the kinds)"]
    return {"rows": rows, "top": top_ops, "rate": rate, "traced_ms": traced * 1e3, "busy_ms": busy / steps * 1e3,
            "concurrent_ms": concurrent / steps * 1e3, "notes": notes}


def busy_and_concurrent(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """Seconds covered by at least one interval, and by at least two at once."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    busy = concurrent = 0.0
    running, last = 0, None
    for moment, change in edges:
        if last is not None:
            busy += (moment - last) if running >= 1 else 0.0
            concurrent += (moment - last) if running >= 2 else 0.0
        running, last = running + change, moment
    return busy, concurrent


def matmul_shapes(config, batch: int, seq_len: int) -> dict[str, tuple[tuple, tuple, str]]:
    """The forward products of a train step: name -> (lhs shape, rhs shape, einsum). The
    backward pass multiplies the same shapes transposed."""
    tokens, heads, head_dim = batch * seq_len, config.num_heads, config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "q/k/v/output projection": ((tokens, hidden), (hidden, hidden), "te,ef->tf"),
        "feed-forward in": ((tokens, hidden), (hidden, inner), "te,ef->tf"),
        "feed-forward out": ((tokens, inner), (inner, hidden), "te,ef->tf"),
        "attention scores (batched)": ((batch * heads, seq_len, head_dim), (batch * heads, seq_len, head_dim),
                                       "nqd,nkd->nqk"),
        "attention values (batched)": ((batch * heads, seq_len, seq_len), (batch * heads, seq_len, head_dim),
                                       "nqk,nkd->nqd"),
        "MLM decoder (masked positions)": ((batch * num_predictions(seq_len), config.embedding_size or hidden),
                                           (config.vocab_size, config.embedding_size or hidden), "ne,ve->nv"),
    }


def time_matmuls(config, batch: int, seq_len: int, dtype: str, iters: int = 10) -> list[dict]:
    """Each of the step's matmul shapes alone (and a 2,048^2 one): ms, GFLOP/s and CPU seconds
    per wall-clock second over the timed calls."""
    calls = {}
    for name, (lhs_shape, rhs_shape, spec) in matmul_shapes(config, batch, seq_len).items():
        lhs = jax.random.normal(jax.random.key(0), lhs_shape, dtype=dtype)
        rhs = jax.random.normal(jax.random.key(1), rhs_shape, dtype=dtype)
        product = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b))
        contracted = lhs_shape[-1]
        flops = 2.0 * contracted * jax.eval_shape(product, lhs, rhs).size
        calls[name] = ((lambda product=product, lhs=lhs, rhs=rhs: product(lhs, rhs)), flops)
    calls[PROBE_ROW] = matmul_probe(2048, dtype)
    rows = []
    for name, (call, flops) in calls.items():
        warm_up({name: call}, 3)
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall_start = time.perf_counter()
        seconds = time_call(call, iters)
        wall = time.perf_counter() - wall_start
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        rows.append({"matmul": name, "ms": seconds * 1e3, "GFLOP/s": flops / seconds / 1e9,
                     "cpu_per_wall": cpu / wall})
    return rows


def early_returns(rate: dict[str, float], program: dict[str, dict], probe_gflops: float,
                  margin: float = 1.5) -> list[str]:
    """A note on the traced matmul ops whose time implies more than `margin` x the probe's
    rate: they returned before their product was done (XLA:CPU runs some dots, e.g. those it
    hands to Eigen, on its thread pool after the op's event ends), so their time is counted
    in the ops traced while they finish, which look slower than they are."""
    fast = sorted((name for name, gflops in rate.items() if gflops > margin * probe_gflops),
                  key=lambda name: program[name]["flops"], reverse=True)
    if not fast:
        return []
    listed = ", ".join(f"{name} ({program[name]['flops'] / 1e9:.2f} GFLOP at {rate[name]:,.0f} GFLOP/s)"
                       for name in fast[:4])
    return [f"{len(fast)} matmul op(s) traced above {margin}x the {probe_gflops:.0f} GFLOP/s probe, e.g. {listed}: "
            f"they finish after their trace event ends, and their time is counted in the ops traced meanwhile"]


def _short_op(op_name: str) -> str:
    """The jax operation an instruction comes from, without the jit(...) prefix."""
    first = op_name.split(";")[0]
    return re.sub(r"^jit\([^)]*\)/", "", first)


def read_kept_trace(trace_dir: Path, steps: int, top: int) -> dict:
    """The kinds and most expensive ops of a trace kept by an earlier `--trace-dir` run."""
    programs = sorted(trace_dir.rglob("train_step.hlo.txt"))
    if not programs:
        raise SystemExit(f"no train_step.hlo.txt under {trace_dir}: keep a trace with --trace-dir first")
    program = parse_program(programs[0].read_text())
    try:
        trace_events = _trace_events(trace_dir)   # read once: its kernels and whether they ran on a GPU
    except RuntimeError:
        raise SystemExit(f"no *.trace.json.gz under {trace_dir}") from None
    breakdown = step_breakdown(_op_events(trace_events), program, steps, top, library_kernels=_on_gpu(trace_events))
    return {"rows": breakdown["rows"], "tables": {"most expensive ops": {"rows": breakdown["top"]}},
            "traced_ms": breakdown["traced_ms"], "busy_ms": breakdown["busy_ms"],
            "concurrent_ms": breakdown["concurrent_ms"],
            "notes": [f"read from {trace_dir}: {breakdown['traced_ms']:.1f} ms of ops per step over {steps} traced steps",
                      *breakdown["notes"]],
            "settings": {"from_trace": str(trace_dir), "steps": steps, "top": top}}


def run(args: SimpleNamespace) -> dict:
    if args.from_trace:
        return read_kept_trace(args.from_trace, args.steps, args.top)
    config = step_bench.model_config(args.size, args.scheme, args, args.seq_len,
                                     hidden_dropout=args.hidden_dropout)
    fallback = []
    try:
        workload = build_train_workload(config, batch_size=args.batch, seq_len=args.seq_len,
                                        attention_impl=args.attention_impl)
    except Exception as error:   # noqa: BLE001 (a device's time is scarce: profile XLA attention instead)
        if args.attention_impl != "cudnn":
            raise
        fallback.append(f"cuDNN attention failed ({failure(error)}); profiled with XLA attention")
        workload = build_train_workload(config, batch_size=args.batch, seq_len=args.seq_len, attention_impl="xla")
    warm_up({"step": workload.step}, TRAIN_STEP_WARMUP)
    untraced_steps = max(args.steps, 3)
    before = resource.getrusage(resource.RUSAGE_SELF)
    step_ms = time_call(workload.step, untraced_steps) * 1e3
    after = resource.getrusage(resource.RUSAGE_SELF)
    # Kernel time is part of a step too: page faults of freshly mapped buffers land inside
    # whichever op first touches them (docs/results/archive/2026-11-25-host-memory-cpu.md).
    kernel = {"page_faults_per_step": (after.ru_minflt - before.ru_minflt) / untraced_steps,
              "system_cpu_ms_per_step": (after.ru_stime - before.ru_stime) * 1e3 / untraced_steps,
              "user_cpu_ms_per_step": (after.ru_utime - before.ru_utime) * 1e3 / untraced_steps}
    with tempfile.TemporaryDirectory() as scratch:
        trace_dir = args.trace_dir or Path(scratch)
        with jax.profiler.trace(str(trace_dir)):
            for _ in range(args.steps):
                jax.block_until_ready(workload.step())
        events = op_events(trace_dir)
    hlo_text = workload.step_fn.as_text()
    program = parse_program(hlo_text)
    if args.trace_dir:   # the compiled program beside its trace, to read the ops' fusions
        (args.trace_dir / "train_step.hlo.txt").write_text(hlo_text)

    breakdown = step_breakdown(events, program, args.steps, args.top, library_kernels=jax.default_backend() == "gpu")
    notes = fallback + [f"{args.size}/{args.seq_len}/{args.batch} {args.scheme} {args.dtype}: "
             f"{step_ms:.1f} ms per step untraced (median of {untraced_steps}), {breakdown['traced_ms']:.1f} ms of ops "
             f"in the trace, {workload.flops_per_step / 1e9:.1f} GFLOP per step",
             f"per untraced step: {kernel['page_faults_per_step']:,.0f} minor page faults, "
             f"{kernel['system_cpu_ms_per_step']:.0f} ms system CPU, {kernel['user_cpu_ms_per_step']:.0f} ms user CPU",
             breakdown["notes"][0]]
    matmuls = time_matmuls(config, args.batch, args.seq_len, args.dtype)
    probe = next(row for row in matmuls if row["matmul"] == PROBE_ROW)
    if jax.default_backend() == "cpu":   # a GPU's kernel events are timed on the device, and its probe
        notes += early_returns(breakdown["rate"], program, probe_gflops=probe["GFLOP/s"])   # pays the per-call floor
    if args.trace_dir:
        notes.append(f"trace kept in {args.trace_dir} (TensorBoard profile plugin or Perfetto), "
                     "with the compiled step as train_step.hlo.txt")
    return {"rows": breakdown["rows"], "tables": {"most expensive ops": {"rows": breakdown["top"]},
                                                  "the step's matmul shapes alone": {"rows": matmuls}},
            "step_ms": step_ms, "traced_ms": breakdown["traced_ms"], "busy_ms": breakdown["busy_ms"],
            "concurrent_ms": breakdown["concurrent_ms"], "kernel": kernel, "notes": notes,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}}
