"""cost: the train step's time on an H100 or H200, predicted on a host without a GPU.

Compiles the real train step (roformer.deviceless: the benchmarks' TrainSetup workload, any
size, length, batch, scheme, dtype, backend forms and XLA options) for the GPU named by --gpu
and predicts its time from the optimised program (roformer.bench.gpu_cost): per category of
kernel (GEMM, attention, the memory-bound groups, the optimizer) the kernels, bytes, FLOPs and
predicted ms, then the step time and the MFU it implies (the project's FLOP count,
roformer.train.flops, over the vendor's peak, as `bench step` divides on a GPU). The
calibration it uses is printed with the pages it comes from.

--variant NAME:KEY=VALUE[;KEY=VALUE...] adds a variant of the same step (repeatable), compiled and
predicted beside it, with its predicted change: e.g. `dropout0:hidden_dropout=0`,
`logits:forms=bf16_mlm_logits`, `batch128:batch=128`, `notriton:xla_gpu_enable_triton_gemm=true`,
`full:remat=full` (keys: the StepSpec fields, `forms` comma-separated (`forms=` none), or an `xla_...` compiler
option). Needs the CUDA plugin (pip install -e .[cuda13], Python 3.12+); no GPU. A base/512/64
compile takes minutes on a small CPU: --hlo-dir keeps each program and reads it back next time
(delete it after changing the model).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from collections.abc import Mapping

from roformer import cli
from roformer import deviceless
from roformer.bench import gpu_cost, workload
from roformer.errors import ConfigError
from roformer.files import write_text_atomic
from roformer.model import ModelConfig, backend
from roformer.train import flops as train_flops
from roformer.train import optim, sharding
from roformer.train.state import TrainSetup

@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One train step as the benchmarks build it (roformer.bench.workload): size preset,
    sequence length, batch, position scheme, compute dtype, attention implementation, the
    hidden and attention dropout, the dropout keys, the encoder layers' gradient checkpointing
    (`model.remat`), backend forms (None: the GPU's default set) and XLA options passed to the
    compiler (`xla_gpu_...` names)."""
    size: str = "base"
    seq_len: int = 512
    batch: int = 64
    scheme: str = "rope"
    dtype: str = "bfloat16"
    attention_impl: str = "auto"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.0
    dropout_rng_impl: str = "threefry2x32"
    vocab_size: int = 30522
    remat: str = "none"
    forms: tuple[str, ...] | None = None
    compiler_options: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_preset(self.size, position=self.scheme, dtype=self.dtype, vocab_size=self.vocab_size,
                                       max_position_embeddings=max(512, self.seq_len),
                                       hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
                                       attention_impl=self.attention_impl, remat=self.remat)


def compile_spec(spec: StepSpec, gpu: str) -> tuple[deviceless.CompiledStep, float]:
    """The benchmarks' train workload of `spec` compiled for one GPU of kind `gpu`, and its
    FLOPs as MFU counts them."""
    config = spec.model_config()
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=deviceless.target_devices(gpu)[:1])
    tx, schedule = optim.make_optimizer(**workload.train_config())
    setup = TrainSetup(config, tx, schedule, mesh, dropout_rng_impl=spec.dropout_rng_impl)
    compiled = deviceless.compile_train_step(setup, workload.synthetic_batch(config, spec.batch, spec.seq_len),
                                             forms=spec.forms, compiler_options=spec.compiler_options)
    return compiled, train_flops.train_flops_per_step(config, batch_size=spec.batch, seq_len=spec.seq_len,
                                                      num_predictions=workload.num_predictions(spec.seq_len))


COLUMNS = ("category", "kernels", "GB", "GFLOP", "ms", "ms_with_launch", "share")
COMPARE_COLUMNS = ("variant", "gpu", "kernels", "GB_memory_bound", "pred_ms", "delta_ms", "pred_mfu", "peak_GB",
                   "forms", "compile_s")


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--gpu", many=True, default=["h200"], choices=sorted(deviceless.GPU_KINDS))
    command.define("--size", default="base")
    command.define("--seq-len", type=int, default=512)
    command.define("--batch", type=int, default=64)
    command.define("--scheme", default="rope")
    command.define("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    command.define("--attention-impl", default="auto", choices=["auto", "xla", "cudnn"])
    command.define("--hidden-dropout", type=float, default=0.1)
    command.define("--attention-dropout", type=float, default=0.0)
    command.define("--dropout-rng-impl", default="threefry2x32")
    command.define("--vocab-size", type=int, default=30522)
    command.define("--remat", default="none", help="the encoder layers' gradient checkpointing (model.remat)")
    command.define("--forms", default=None,
                   help="backend forms, comma-separated ('' for none; default: the GPU's default set)")
    command.define("--variant", repeat=True, default=[], metavar="NAME:KEY=VALUE[;...]",
                   help="a variant predicted beside the step (repeatable)")
    command.define("--hlo-dir", type=Path, default=None,
                   help="keep each compiled program here, and read one already there instead of compiling")


def parse_variant(text: str, base: StepSpec) -> tuple[str, StepSpec]:
    """'NAME:key=value;key=value' -> (NAME, base with those fields changed)."""
    name, _, settings = text.partition(":")
    if not name or not settings:
        raise ConfigError(f"--variant {text!r}: write NAME:KEY=VALUE[;KEY=VALUE...]")
    fields = {field.name: field for field in dataclasses.fields(StepSpec)}
    changes, options = {}, dict(base.compiler_options)
    for item in settings.split(";"):
        key, _, value = item.partition("=")
        key = key.strip()
        if key.startswith("xla_"):
            options[key] = {"true": True, "false": False}.get(value.lower(), value)
        elif key == "forms":
            changes["forms"] = tuple(form for form in value.split(",") if form)
        elif key in fields and key != "compiler_options":
            default = getattr(base, key)
            changes[key] = type(default)(value) if default is not None else value
        else:
            raise ConfigError(f"--variant {text!r}: unknown key {key!r}; use a StepSpec field, forms or an xla_ option")
    return name, dataclasses.replace(base, compiler_options=options, **changes)


def base_spec(args: SimpleNamespace) -> StepSpec:
    forms = None if args.forms is None else tuple(form for form in args.forms.split(",") if form)
    return StepSpec(size=args.size, seq_len=args.seq_len, batch=args.batch, scheme=args.scheme,
                    dtype=args.dtype, attention_impl=args.attention_impl,
                    hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                    dropout_rng_impl=args.dropout_rng_impl, vocab_size=args.vocab_size, remat=args.remat,
                    forms=forms)


def code_digest() -> str:
    """A digest of the code a step's program is traced from (the model and the train step)
    and of the compiler's default options: a kept program of other code is not read back."""
    root = Path(deviceless.__file__).parent
    files = sorted([*(root / "model").glob("*.py"), *(root / "train").glob("*.py")])
    text = b"".join(path.read_bytes() for path in files) + repr(deviceless.DEFAULT_COMPILER_OPTIONS).encode()
    return hashlib.sha1(text).hexdigest()[:12]


def compiled_program(spec: StepSpec, gpu: str, hlo_dir: Path | None) -> dict:
    """{hlo_text, memory, compile_s, flops, forms} of the step for `gpu`, read from hlo_dir when
    it holds this spec's program from this code."""
    # The key names the forms themselves (not "the default set"), in one order.
    spec = dataclasses.replace(spec, forms=tuple(sorted(backend.DEFAULT_FORMS["gpu"] if spec.forms is None
                                                         else spec.forms)))
    key = hashlib.sha1(repr((gpu, dataclasses.asdict(spec), code_digest())).encode()).hexdigest()[:12]
    path = hlo_dir / f"{gpu}-{key}.json" if hlo_dir else None
    if path is not None and path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    print(f"cost: compiling {spec.size}/{spec.seq_len}/{spec.batch} for {gpu} ...", file=sys.stderr, flush=True)
    compiled, flops = compile_spec(spec, gpu)
    result = {"hlo_text": compiled.hlo_text, "memory": compiled.memory, "compile_s": round(compiled.compile_s, 1),
              "flops": flops, "forms": list(compiled.forms), "spec": dataclasses.asdict(spec)}
    if path is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(result))
    return {**result, "cached": False}


def predict_program(program: dict, gpu: str) -> dict:
    """The prediction for one compiled program: per-category rows and the step's totals."""
    calibration = gpu_cost.CALIBRATIONS[gpu]
    found = gpu_cost.kernels(gpu_cost.Program.parse(program["hlo_text"]))
    prediction = gpu_cost.predict(found, calibration)
    rows = [{**row, "share": row["ms_with_launch"] / (prediction.step_s * 1e3)} for row in prediction.rows]
    memory_bound = sum(row["GB"] for row in rows if row["category"] not in ("GEMM", "attention"))
    return {"rows": rows, "step_ms": prediction.step_s * 1e3, "kernels": prediction.kernels,
            "launch_ms": prediction.launch_s * 1e3, "GB_memory_bound": memory_bound,
            "mfu": prediction.mfu(program["flops"], calibration.peak_flops),
            "peak_GB": program["memory"].get("peak_memory_in_bytes", 0) / 1e9}


def run(args: SimpleNamespace) -> dict:
    base = base_spec(args)
    variants = [("baseline", base)] + [parse_variant(text, base) for text in args.variant]
    compare, tables, notes, details = [], {}, [], {}
    for gpu in args.gpu:
        reference = None
        for name, spec in variants:
            program = compiled_program(spec, gpu, args.hlo_dir)
            figures = predict_program(program, gpu)
            reference = figures["step_ms"] if reference is None else reference
            details[f"{gpu}/{name}"] = {**figures, "spec": dataclasses.asdict(spec), "memory": program["memory"]}
            compare.append({"variant": name, "gpu": gpu, "kernels": figures["kernels"],
                            "GB_memory_bound": figures["GB_memory_bound"], "pred_ms": figures["step_ms"],
                            "delta_ms": figures["step_ms"] - reference, "pred_mfu": figures["mfu"],
                            "peak_GB": figures["peak_GB"], "forms": ",".join(program["forms"]) or "none",
                            "compile_s": "cached" if program["cached"] else program["compile_s"]})
            if name != "baseline":
                tables[f"{gpu} {name}: predicted ms per category"] = {"rows": figures["rows"], "columns": COLUMNS}
        tables[f"{gpu} calibration"] = {"rows": gpu_cost.calibration_rows(gpu_cost.CALIBRATIONS[gpu]),
                                        "columns": ("constant", "value", "how")}
    first = details[f"{args.gpu[0]}/baseline"]
    tables["predicted step, each variant"] = {"rows": compare, "columns": COMPARE_COLUMNS}
    notes.append(f"{args.gpu[0]} baseline: {first['kernels']} kernels, predicted {first['step_ms']:.2f} ms "
                 f"(launch gaps {first['launch_ms']:.2f} ms), MFU {first['mfu']:.1%}")
    notes.append("a prediction from the compiled program and the calibration above, not a measurement")
    return {"rows": first["rows"], "columns": COLUMNS, "tables": tables, "notes": notes, "predictions": details}
