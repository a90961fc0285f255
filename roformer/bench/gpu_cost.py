"""A GPU train step's time, predicted from its optimised program (roformer.deviceless).

Every kernel the program launches is put in a category by where its instructions were traced
from (the program's stack frames: the model's, optax's, jax.random's functions) and timed by
one rule:

  GEMM        cuBLAS/cuBLASLt calls and XLA's GEMM fusions: FLOPs / a calibrated rate (at
              least their bytes / the effective bandwidth);
  attention   cuDNN's fused attention: FLOPs (as MFU counts them: 4 B H Lq Lk D forward, twice
              that backward) / a calibrated rate each way;
  the rest    memory-bound: bytes read and written / the effective bandwidth;

plus a launch gap per kernel. The constants come from a traced step (CALIBRATIONS names the
page of each). Nothing here runs on a GPU or needs jax: it reads program text, so the tests
run anywhere.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

# ---- The calibration: the one place the model's constants live ---------------------------


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The rates one GPU kind runs the step's kernels at, and where each figure comes from."""
    gpu: str
    peak_flops: float                # vendor dense bf16 peak (MFU's denominator)
    memory_bandwidth: float          # vendor figure, bytes/s
    bandwidth_fraction: float        # memory-bound kernels' effective share of it
    gemm_flops: float                # FLOP/s of the step's GEMMs
    attention_fwd_flops: float       # FLOP/s of cuDNN's forward (MFU's count)
    attention_bwd_flops: float       # FLOP/s of its backward with its helper kernels (MFU's count)
    launch_s: float                  # gap per kernel launch (untraced step - traced kernel time) / kernels
    sources: tuple[str, ...]

    @property
    def bandwidth(self) -> float:
        return self.memory_bandwidth * self.bandwidth_fraction


# From the H100 trace of base/512/64 bf16 (docs/results/2026-11-26-accelerator-h100.md, "Where
# the base/512 step's time goes"), read against the deviceless program of that step
# (docs/results/2026-12-07-gpu-cost-model.md):
# - memory-bound kernels: 26.4 ms traced (12.6 reductions + 13.8 elementwise) for the 55.1 GB
#   the program's other kernels move: 0.622 of the vendor's bandwidth;
# - GEMMs: 25.1 ms traced (20.7 cuBLAS + 4.4 XLA GEMM fusions); the rate is the one at which
#   the program's GEMMs (FLOPs / rate, at least bytes / bandwidth) sum to that;
# - cuDNN attention: forward 3.1 ms, backward 6.6 ms + 1.6 ms of helpers, for 1.85 TFLOP as
#   MFU counts it (a third forward);
# - launch gaps: 66.8 ms untraced against 62.7 ms of kernels, over 1,322 kernels.
# The H200 shares the H100's SMs and clock, so only its bandwidth differs; its pages check the
# prediction, they are not fitted.
_ATTENTION_MFU_FLOP = 1.85e12 / 3
H100_SOURCE = "docs/results/2026-11-26-accelerator-h100.md"
_H100_FIT = dict(
    bandwidth_fraction=0.6223,
    gemm_flops=715.2e12,
    attention_fwd_flops=_ATTENTION_MFU_FLOP / 3.1e-3,
    attention_bwd_flops=2 * _ATTENTION_MFU_FLOP / (6.6e-3 + 1.6e-3),
    launch_s=(66.8e-3 - 62.7e-3) / 1322,
)
CALIBRATIONS: dict[str, Calibration] = {
    "h100": Calibration("h100", peak_flops=989e12, memory_bandwidth=3.35232e12, sources=(H100_SOURCE,), **_H100_FIT),
    "h200": Calibration("h200", peak_flops=989e12, memory_bandwidth=4.8e12,
                        sources=(H100_SOURCE, "(bandwidth: the vendor's 4.8 TB/s at the H100's fraction)"),
                        **_H100_FIT),
}

# ---- Reading the program ------------------------------------------------------------------

CATEGORIES = ("GEMM", "attention", "residual+dropout+LayerNorm", "bias+GELU", "RoPE", "MLM head and loss",
              "embeddings", "attention layout", "dropout bits", "optimizer", "other")
# A kernel whose instructions come from several places takes the first of these it touches.
# The embeddings come late: XLA shares the dropout masks' counter arithmetic among sites, so a
# layer's kernel may carry a frame of the embeddings' dropout.
_PRIORITY = ("optimizer", "MLM head and loss", "RoPE", "residual+dropout+LayerNorm", "bias+GELU", "attention layout",
             "embeddings", "dropout bits", "other")
_OPTIMIZER = re.compile(r"^(chain|apply_updates|clip_by_global_norm|tree_norm|tree_sum|scale_by_|add_decayed|"
                        r"masked\.|tree_bias|tree_update|make_keyed_train_step\.<locals>\.train_step\.<locals>)")
_INNERMOST = (   # the first of a chain's functions (innermost first) that one of these matches decides
    ("RoPE", re.compile(r"^(apply_rope|rope_|Rotary\.|complex_product|_rotation_tangent|rotate_pairs|shared_table)")),
    ("residual+dropout+LayerNorm", re.compile(r"^(LayerNorm\.|_compute_stats|_normalize|RoFormerOutput\.add_and_norm|"
                                              r"residual_layer_norm)")),
    ("bias+GELU", re.compile(r"^(Dense\.|token_matmul|gelu|RoFormerIntermediate)")),
    ("attention layout", re.compile(r"^(softmax_attention|RoFormerSelfAttention|dot_product_attention)")),
    ("dropout bits", re.compile(r"^(Dropout\.|RngStream|reseeded|bernoulli|_bernoulli|random_bits|threefry|_uniform)")),
)
_SKIPPED = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all", "partition-id",
            "replica-id", "opt-barrier"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+) .*\{\s*$")
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                  "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass
class Kernel:
    name: str
    opcode: str
    category: str
    bytes: int
    flops: float = 0.0
    calls: int = 1          # launches (a while loop's body runs its trip count)
    backward: bool = False  # attention: the backward call


def _arrays(shape: str) -> list[tuple[str, list[int]]]:
    return [(dtype, [int(d) for d in dims.split(",") if d])
            for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]", shape)]


def shape_bytes(shape: str, *, workspace: bool = True) -> int:
    """Bytes of an array or tuple shape; `workspace=False` leaves out a library call's s8/u8
    scratch buffer (the last element of its result tuple)."""
    arrays = _arrays(shape)
    if not workspace and len(arrays) > 1 and arrays[-1][0] in ("s8", "u8"):
        arrays = arrays[:-1]
    return sum(_ELEMENT_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in arrays)


def operand_names(rest: str) -> list[str]:
    """Operand names of an instruction, from the text after its opcode's '(' (as written: an
    operand used twice is named twice)."""
    depth, end = 1, len(rest)
    for index, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = index
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _operands(rest: str) -> list[str]:
    return list(dict.fromkeys(operand_names(rest)))   # each operand read once


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    rest: str


@dataclasses.dataclass
class Program:
    """The parts of an optimised HLO module's text the model reads."""
    computations: dict[str, list[_Instruction]]
    entry: str
    frames: dict[int, tuple[str, int]]       # stack frame id -> (function name, parent id)

    @classmethod
    def parse(cls, text: str) -> "Program":
        computations: dict[str, list[_Instruction]] = {}
        entry, current, section = "", None, None
        functions: dict[int, str] = {}
        locations: dict[int, int] = {}
        raw_frames: dict[int, tuple[int, int]] = {}
        for line in text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section, current = line, None
                continue
            header = _COMPUTATION.match(line)
            if header and not line.startswith(" "):
                section, current = None, computations.setdefault(header.group(2), [])
                entry = header.group(2) if header.group(1) else entry
                continue
            if section == "FunctionNames" and (m := re.match(r'^(\d+) "(.*)"$', line)):
                functions[int(m.group(1))] = m.group(2)
            elif section == "FileLocations" and (m := re.match(r"^(\d+) \{.*function_name_id=(\d+)", line)):
                locations[int(m.group(1))] = int(m.group(2))
            elif section == "StackFrames" and (m := re.match(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)):
                raw_frames[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
            elif current is not None and (m := _INSTRUCTION.match(line)):
                current.append(_Instruction(m.group(1), m.group(2), m.group(3), m.group(4)))
        frames = {frame: (functions.get(locations.get(location, -1), ""), parent - 1)
                  for frame, (location, parent) in raw_frames.items()}   # the text gives parent + 1 (0: none)
        return cls(computations, entry, frames)

    def chain(self, frame: int) -> list[str]:
        """Function names of a stack frame, innermost first."""
        names, seen = [], set()
        while frame in self.frames and frame not in seen:
            seen.add(frame)
            name, parent = self.frames[frame]
            names.append(name)
            frame = parent
        return names

    def called(self, instruction: _Instruction) -> list[str]:
        return re.findall(r"(?:calls|to_apply|body|condition|branch_computations=\{)=?%([\w.\-]+)", instruction.rest)

    def frames_of(self, instruction: _Instruction, seen: set | None = None) -> list[int]:
        """Stack frames of an instruction and of every instruction in the computations it fuses
        (not its reducers: XLA shares one reducer among unrelated reductions)."""
        seen = set() if seen is None else seen
        found = [int(m) for m in re.findall(r"stack_frame_id=(\d+)", instruction.rest)]
        for name in re.findall(r"calls=%([\w.\-]+)", instruction.rest):
            if name not in seen:
                seen.add(name)
                for inner in self.computations.get(name, ()):
                    found += self.frames_of(inner, seen)
        return found


def instruction_category(chain: list[str]) -> str:
    """The category of one traced operation from its functions, innermost first."""
    names = set(chain)
    if any(_OPTIMIZER.match(name) for name in names):
        return "optimizer"
    if "RoFormerLMPredictionHead.__call__" in names or "softmax_cross_entropy_with_integer_labels" in names \
            or ("mlm_sums" in names and "RoFormerForMaskedLM.__call__" not in names):
        return "MLM head and loss"
    if "RoFormerEmbeddings.__call__" in names:
        return "embeddings"
    if chain[:2] == ["<lambda>", "RoFormerLayer.__call__"]:   # the activation (encoder.ACTIVATIONS' lambdas)
        return "bias+GELU"
    for name in chain:
        for category, pattern in _INNERMOST:
            if pattern.match(name):
                return category
    return "other"


def kernel_category(categories: Iterable[str]) -> str:
    found = set(categories)
    return next((category for category in _PRIORITY if category in found), "other")


def attention_flops(instruction_rest: str, result_shape: str, backward: bool) -> float:
    """MFU's count for one cuDNN fused attention call: 2 products of 2 B H Lq Lk D forward,
    twice that backward, from the call's intermediate [B, H, Lq, Lk] shape and head size D."""
    intermediate = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', instruction_rest)
    arrays = _arrays(result_shape)
    if not intermediate or not arrays:
        return 0.0
    dims = [int(d) for d in re.findall(r"\d+", intermediate.group(1))]
    head_dim = arrays[0][1][-1]
    forward = 4.0 * math.prod(dims) * head_dim
    return 2 * forward if backward else forward


def gemm_flops(instruction: _Instruction, shapes: dict[str, str]) -> float:
    """2 x result elements x contracted size of a library GEMM (its backend config's
    dimension numbers) or of a dot."""
    key = r'"lhs_contracting_dimensions":\[([^\]]*)\]' if instruction.opcode == "custom-call" \
        else r"lhs_contracting_dims=\{([\d,]*)\}"
    contracting = re.search(key, instruction.rest)
    operands = _operands(instruction.rest)
    arrays = _arrays(instruction.shape)
    if not (contracting and operands and arrays):
        return 0.0
    lhs = _arrays(shapes.get(operands[0], ""))
    lhs_dims = lhs[0][1] if lhs else []
    axes = [int(d) for d in re.findall(r"\d+", contracting.group(1))]
    return 2.0 * math.prod(arrays[0][1]) * math.prod(lhs_dims[a] for a in axes if a < len(lhs_dims))


def _trip_count(instruction: _Instruction) -> int:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.rest)
    return int(known.group(1)) if known else 1


def kernels(program: Program, computation: str | None = None, calls: int = 1) -> list[Kernel]:
    """The kernels one run of `computation` (the entry) launches, each with its category,
    bytes and FLOPs. A while loop's body counts its known trip count (1 when unknown)."""
    instructions = program.computations.get(computation or program.entry, [])
    shapes = {i.name: i.shape for i in instructions}
    found = []
    for instruction in instructions:
        opcode = instruction.opcode
        if opcode in _SKIPPED:
            continue
        if opcode in ("while", "call", "async-start", "conditional"):
            body = re.search(r"body=%([\w.\-]+)", instruction.rest) or re.search(r"(?:to_apply|calls)=%([\w.\-]+)",
                                                                                instruction.rest)
            if body:
                found += kernels(program, body.group(1), calls * _trip_count(instruction))
            continue
        if opcode in ("async-done", "async-update"):
            continue
        operands_bytes = sum(shape_bytes(shapes.get(name, "")) for name in _operands(instruction.rest))
        size = operands_bytes + shape_bytes(instruction.shape, workspace=False)
        target = re.search(r'custom_call_target="([^"]*)"', instruction.rest)
        target = target.group(1) if target else ""
        inner = [i.opcode for name in program.called(instruction) for i in program.computations.get(name, ())]
        if "fmha" in target:
            backward = "Backward" in target
            flops = attention_flops(instruction.rest, instruction.shape, backward=backward)
            found.append(Kernel(instruction.name, opcode, "attention", size, flops, calls, backward))
        elif re.search(r"gemm|matmul", target) or opcode in ("dot", "convolution") or "dot" in inner:
            flops = gemm_flops(instruction, shapes)
            if not flops and "dot" in inner:
                callee = next(iter(program.called(instruction)), "")
                callee_instructions = program.computations.get(callee, [])
                callee_shapes = {i.name: i.shape for i in callee_instructions}
                flops = sum(gemm_flops(i, callee_shapes) for i in callee_instructions if i.opcode == "dot")
            found.append(Kernel(instruction.name, opcode, "GEMM", size, flops, calls))
        else:
            categories = [instruction_category(program.chain(frame)) for frame in program.frames_of(instruction)]
            found.append(Kernel(instruction.name, opcode, kernel_category(categories), size, 0.0, calls))
    return found


# ---- The prediction -----------------------------------------------------------------------


def kernel_seconds(kernel: Kernel, calibration: Calibration) -> float:
    """One launch's predicted time, without its launch gap."""
    memory = kernel.bytes / calibration.bandwidth
    if kernel.category == "GEMM":
        return max(kernel.flops / calibration.gemm_flops, memory)
    if kernel.category == "attention":
        rate = calibration.attention_bwd_flops if kernel.backward else calibration.attention_fwd_flops
        return max(kernel.flops / rate, memory)
    return memory


@dataclasses.dataclass
class Prediction:
    rows: list[dict]          # one per category: kernels, GB, GFLOP, ms
    step_s: float
    kernels: int
    launch_s: float

    def mfu(self, flops_per_step: float, peak_flops: float) -> float:
        return flops_per_step / self.step_s / peak_flops


def predict(found: list[Kernel], calibration: Calibration) -> Prediction:
    """Per category and in all: the step time the calibration predicts for these kernels."""
    rows = []
    for category in CATEGORIES:
        mine = [k for k in found if k.category == category]
        if not mine:
            continue
        seconds = sum(k.calls * kernel_seconds(k, calibration) for k in mine)
        launches = sum(k.calls for k in mine)
        rows.append({"category": category, "kernels": launches, "GB": sum(k.calls * k.bytes for k in mine) / 1e9,
                     "GFLOP": sum(k.calls * k.flops for k in mine) / 1e9, "ms": seconds * 1e3,
                     "ms_with_launch": (seconds + launches * calibration.launch_s) * 1e3})
    launches = sum(k.calls for k in found)
    launch_s = launches * calibration.launch_s
    step_s = sum(row["ms"] for row in rows) / 1e3 + launch_s
    return Prediction(rows, step_s, launches, launch_s)


def calibration_rows(calibration: Calibration) -> list[dict]:
    """The calibration as printable rows."""
    return [
        {"constant": "effective bandwidth (memory-bound kernels)", "value": f"{calibration.bandwidth / 1e12:.2f} TB/s",
         "how": f"{calibration.bandwidth_fraction:.3f} x the vendor's {calibration.memory_bandwidth / 1e12:.2f} TB/s"},
        {"constant": "GEMM rate", "value": f"{calibration.gemm_flops / 1e12:.0f} TFLOP/s",
         "how": "the rate at which the traced step's GEMMs take their traced time"},
        {"constant": "cuDNN attention forward", "value": f"{calibration.attention_fwd_flops / 1e12:.0f} TFLOP/s",
         "how": "MFU's forward count / the forward kernel's traced time"},
        {"constant": "cuDNN attention backward", "value": f"{calibration.attention_bwd_flops / 1e12:.0f} TFLOP/s",
         "how": "MFU's backward count / the backward kernel and its helpers"},
        {"constant": "launch gap per kernel", "value": f"{calibration.launch_s * 1e6:.2f} us",
         "how": "(untraced step - traced kernel time) / kernels per step"},
        {"constant": "peak (MFU)", "value": f"{calibration.peak_flops / 1e12:.0f} TFLOP/s", "how": "vendor dense bf16"},
        {"constant": "sources", "value": "; ".join(calibration.sources), "how": ""},
    ]
