"""Logit parity of a pretraining workdir and its HF export, in transformers, on this machine's
accelerator (or CPU): python scripts/hf_parity.py WORKDIR HF_DIR [--json OUT].

Loads our MLM model from WORKDIR's newest checkpoint (float32, eval mode) and HF_DIR (written
by `python -m roformer.convert to-hf WORKDIR HF_DIR`) with AutoTokenizer and
AutoModelForMaskedLM, tokenizes the same sentences with both tokenizers (ids must match),
runs a right-padded batch through both in float32 and prints the largest absolute logit
difference over real tokens, with the devices each ran on. Exit status 1 when the ids differ
or the difference is above --tolerance.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SENTENCES = [
    "The rotary position embedding encodes absolute positions with a rotation matrix.",
    "It brings explicit relative position dependency into self-attention.",
    "A short one.",
    "Transformers pretrained on Wikipedia are fine-tuned on GLUE, one task at a time, with five seeds each.",
]


def main(argv=None) -> int:
    from roformer import cli

    command = cli.CommandFlags(__doc__.split("\n\n")[0])
    command.define("--json", default="")
    command.define("--tolerance", type=float, default=1e-3)
    with cli.user_errors():
        args, positional = command.parse(sys.argv[1:] if argv is None else argv)
        if len(positional) != 2:
            raise cli.UsageError(f"give WORKDIR and HF_DIR; got {positional}")
    args.workdir, args.hf_dir = positional

    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from roformer.convert import build_model
    from roformer.data.tokenizer import load_tokenizer
    from roformer.workdir import PretrainWorkdir

    config, params = PretrainWorkdir(args.workdir).params(-1)
    config = dataclasses.replace(config, dtype="float32")   # the run may compute in bf16; parity is float32
    ours = build_model(config, "mlm")
    state = nnx.state(ours, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(ours, state)
    ours.eval()
    tokenizer = load_tokenizer(f"{args.workdir}/tokenizer.json")
    hf_tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    ids = [[tokenizer.cls_id, *row, tokenizer.sep_id] for row in
           tokenizer.encode_ids(SENTENCES, add_special_tokens=False)]
    hf_ids = hf_tokenizer(SENTENCES)["input_ids"]
    length = max(map(len, ids))
    batch = np.full((len(ids), length), tokenizer.pad_id, np.int32)
    lengths = np.array([len(row) for row in ids], np.int32)
    for i, row in enumerate(ids):
        batch[i, :len(row)] = row
    with jax.default_matmul_precision("highest"):   # float32 products (jax's GPU default is TF32)
        ours_logits = np.asarray(ours(jnp.asarray(batch), lengths=jnp.asarray(lengths)))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForMaskedLM.from_pretrained(args.hf_dir, dtype=torch.float32).to(device).eval()
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.from_numpy(batch.astype(np.int64)).to(device),
                       attention_mask=torch.from_numpy(mask).to(device)).logits.float().cpu().numpy()
    real = mask.astype(bool)
    diff = float(np.max(np.abs(ours_logits[real] - hf_logits[real])))
    result = {"max_abs_logit_diff": diff, "tolerance": args.tolerance, "ids_equal": ids == hf_ids,
              "hf_class": type(hf).__name__, "tokenizer_class": type(hf_tokenizer).__name__,
              "ours_device": str(jax.devices()[0].device_kind), "hf_device": device,
              "model": {"size_hidden": config.hidden_size, "layers": config.num_layers, "position": config.position}}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ids_equal"] and diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
