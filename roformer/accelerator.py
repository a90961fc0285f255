"""The accelerator setting of the configs, and the line every run logs at start about the
device, compute dtype and attention path it uses.

`accel=gpu` (or `tpu`) in a config argument (`configs/rotary.py:size=base,accel=gpu`,
`configs/glue.py:accel=gpu`) selects what an accelerator runs fastest without changing the
model's parameters: bf16 compute (parameters stay float32) and no attention dropout, as
MosaicBERT, ModernBERT and Cramming train, so that attention_impl=auto takes the fused
kernel. `accel=cpu` keeps the defaults. A command run with `accel=gpu|tpu` where jax sees no
such device (a CPU-only jax, or a GPU plugin that failed to load) is refused before it starts
(`require_accelerator`), instead of training in bf16 on the CPU.
"""
from __future__ import annotations

import os

import jax

from roformer.errors import ConfigError
from roformer.model import backend
from roformer.model.attention import attention_summary

ACCELERATOR_SETTINGS = {
    "cpu": {},
    "gpu": {"dtype": "bfloat16", "attention_dropout": 0.0, "attention_impl": "auto"},
    "tpu": {"dtype": "bfloat16", "attention_dropout": 0.0, "attention_impl": "auto"},
}


def apply_accelerator_setting(model_section, accel: str) -> None:
    """Set `model_section`'s (a config's `model` ConfigDict) fields for `accel`."""
    if accel not in ACCELERATOR_SETTINGS:
        raise ConfigError(f"unknown accel={accel!r}; choose one of {sorted(ACCELERATOR_SETTINGS)}")
    for key, value in ACCELERATOR_SETTINGS[accel].items():
        model_section[key] = value


def requested_accelerator(config_spec: str) -> str:
    """The `accel=` value of a --config argument (`path[:arg]`), "" when it has none."""
    _, _, arg = config_spec.partition(":")
    values = [item.partition("=")[2].strip() for item in arg.split(",") if item.partition("=")[0].strip() == "accel"]
    return values[-1] if values else ""


def require_accelerator(accel: str) -> None:
    """Refuse `accel=gpu|tpu` when jax's backend is not that device (call it once jax may
    start: after roformer.distributed's initialisation on a multi-host job)."""
    if accel not in ("gpu", "tpu") or jax.default_backend() == accel:
        return
    install = "jax's CUDA build (pip install 'roformer-jax[cuda13]')" if accel == "gpu" else "jax[tpu]"
    raise ConfigError(f"accel={accel}, but jax sees no {accel.upper()}: it runs on {device_summary()}; "
                      f"install {install} (docs/install.md; a plugin that failed to load says why with -v 0), "
                      f"or drop accel={accel} to run on the CPU")


def parse_config_arg(arg: str | None, *, flags: tuple[str, ...] = (), keys: tuple[str, ...] = (),
                     where: str = "config") -> dict[str, str]:
    """'smoke,accel=gpu' -> {'smoke': '', 'accel': 'gpu'}: comma-separated flags and
    key=value items, each one a config file knows."""
    out = {}
    for item in (arg or "").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        known = (key in flags and not value) or (key in keys and value)
        if not known:
            choices = [*flags, *(f"{k}=..." for k in keys)]
            raise ConfigError(f"unknown {where} argument {item!r}; choose from {choices}")
        out[key] = value
    return out


def device_summary() -> str:
    """'1 x NVIDIA H200 (gpu)' for the devices this process sees."""
    devices = jax.local_devices()
    kinds = sorted({d.device_kind for d in devices})
    total = jax.device_count()
    hosts = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return f"{total} x {'/'.join(kinds)} ({jax.default_backend()}{hosts})"


def startup_line(model_config, *, training: bool = True) -> str:
    """What a run logs first: devices, compute dtype, attention path and why, and the backend
    forms on (roformer.model.backend; named only when there are any)."""
    forms = backend.active_forms()
    return (f"device: {device_summary()}; compute {model_config.dtype} (parameters float32); "
            f"attention: {attention_summary(model_config, training=training)}"
            + (f"; backend forms: {', '.join(sorted(forms))}" if forms else ""))


def enable_compilation_cache(setting: str) -> str | None:
    """Turn on jax's persistent compilation cache: `setting` a directory, "auto" (a per-user
    cache directory on GPUs and TPUs, off on CPU) or "" (off). Programs compiled once, by
    any run of any command, then load in a fraction of their compile time. Returns the
    directory in use, or None."""
    if setting == "auto":
        if jax.default_backend() == "cpu":
            return None
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        setting = os.path.join(cache_home, "roformer-jax", "xla")
    if not setting:
        return None
    jax.config.update("jax_compilation_cache_dir", setting)
    # every program, not only those compiling for over a second (jax's default): a task's
    # predict programs each compile in under a second, and together they are seconds of
    # every run that the cache would save
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return setting
