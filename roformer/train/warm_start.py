"""Warm start: begin a pretraining run from another run's parameters (fresh optimizer, step 0).

`train.init_from` names a pretraining workdir (`train.init_step`: its checkpoint step, newest
when < 0). The architecture must give every parameter the same shape; settings that change
no parameter (RoPE base or scaling, dropout, dtype, kernels) may differ, which is what a
context-extension stage or continued pretraining at another length needs. The run must use
the checkpoint's tokenizer: the embedding rows mean those tokens.
"""
from __future__ import annotations

import logging

from roformer.model import ModelConfig
from roformer.train.checkpoint import PretrainWorkdir

log = logging.getLogger("roformer.train")


def _shapes(tree: dict, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        out.update(_shapes(value, path) if isinstance(value, dict) else {path: tuple(value.shape)})
    return out


def load_init_params(init_from: str, init_step: int, model_cfg: ModelConfig, abstract_params: dict,
                     tokenizer_hash: str) -> dict:
    """The parameters of `init_from` for a model of `model_cfg`, checked against it."""
    run = PretrainWorkdir(init_from)
    step = run.resolve_step(init_step)
    saved_cfg = run.model_config(step)
    if saved_cfg.position != model_cfg.position:
        raise ValueError(f"train.init_from={init_from}: its position scheme is {saved_cfg.position!r}, "
                         f"this run's is {model_cfg.position!r}")
    if run.tokenizer().hash != tokenizer_hash:
        raise ValueError(f"train.init_from={init_from} was trained with another tokenizer than this "
                         f"run's data.vocab; use its vocabulary: --config.data.vocab={run.tokenizer_file}")
    _, params = run.params(step)
    want, got = _shapes(abstract_params), _shapes(params)
    diffs = [f"{k}: checkpoint {got.get(k)} vs model {want.get(k)}"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    if diffs:
        raise ValueError(f"train.init_from={init_from} (step {step}) does not fit this model: "
                         + "; ".join(diffs[:5]) + (" ..." if len(diffs) > 5 else ""))
    log.info("warm start from %s at step %d (parameters only; fresh optimizer)", run.path, step)
    return params
