"""Our jitted train step vs transformers' PyTorch RoFormerForMaskedLM, same process.

Same model configuration (HF RoFormerConfig built from ours: vocabulary, sizes,
dropout, gelu, rotary on q/k), same synthetic batch, 15% of positions masked, AdamW
with the same hyper-parameters and global-norm clipping on both sides. HF runs
eager PyTorch on all cores as shipped (it computes logits at every position and
takes the loss at the masked ones via -100 labels; ours computes logits only at the
masked positions - that is part of what is being compared). The two steps are timed
in alternating rounds; the speed-up is the median of the per-round ratios
torch time / our time (= our tokens/s over theirs), with min and max.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from roformer.attention import ATTENTION_IMPLEMENTATIONS
from roformer.bench.common import alternate, ratio_stats
from roformer.bench.workload import build_train_workload, synthetic_batch, train_config
from roformer.model import PRESETS, ModelConfig

SPEEDUP_TARGET = 3.0  # at mini, seq 128, batch 32


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="mini", choices=list(PRESETS))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLEMENTATIONS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default (all cores)")


def hf_config(config: ModelConfig):
    from transformers import RoFormerConfig

    return RoFormerConfig(
        vocab_size=config.vocab_size, embedding_size=config.embedding_size or config.hidden_size,
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act, hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
        initializer_range=config.initializer_range, layer_norm_eps=config.layer_norm_eps,
        pad_token_id=config.pad_token_id, rotary_value=config.rotary_value)


def torch_train_step(config: ModelConfig, batch: dict[str, np.ndarray]):
    """A closure running one eager PyTorch AdamW step of HF RoFormerForMaskedLM on `batch`."""
    import torch
    from transformers import RoFormerForMaskedLM as HFRoFormerForMaskedLM

    torch.manual_seed(0)
    model = HFRoFormerForMaskedLM(hf_config(config)).train()
    tc = train_config()
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.learning_rate, betas=(tc.b1, tc.b2),
                                  eps=tc.eps, weight_decay=tc.weight_decay)
    input_ids = torch.from_numpy(batch["input_ids"]).long()
    labels = torch.full_like(input_ids, -100)
    rows = np.arange(input_ids.shape[0])[:, None]
    labels[rows, batch["masked_positions"]] = torch.from_numpy(batch["masked_labels"]).long()
    inputs = {"input_ids": input_ids, "token_type_ids": torch.from_numpy(batch["token_type_ids"]).long(),
              "attention_mask": torch.ones_like(input_ids), "labels": labels}

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
        optimizer.step()
        return None

    return step


def run(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    config = ModelConfig.from_preset(args.size, vocab_size=args.vocab_size)
    ours = build_train_workload(config, batch_size=args.batch, seq_len=args.seq_len,
                                attention_impl=args.attention_impl)
    theirs = torch_train_step(config, synthetic_batch(config, args.batch, args.seq_len))
    times = alternate({"ours_jax": ours.step, "hf_torch": theirs}, rounds=args.rounds, iters=args.iters, warmup=1)
    tokens = args.batch * args.seq_len
    speedup = ratio_stats(times["hf_torch"], times["ours_jax"])
    rows = [{"impl": name, "size": args.size, "seq": args.seq_len, "batch": args.batch,
             "ms_step": statistics.median(t) * 1e3, "tokens_s": tokens / statistics.median(t)}
            for name, t in times.items()]
    rows[0].update(speedup=speedup["median"], speedup_min=speedup["min"], speedup_max=speedup["max"])
    comparison = {"name": f"ours / HF torch tokens/s [{args.size} seq {args.seq_len} batch {args.batch}]",
                  "rounds": args.rounds, **speedup}
    if (args.size, args.seq_len, args.batch) == ("mini", 128, 32):
        comparison.update(target=f">= {SPEEDUP_TARGET}", met=speedup["median"] >= SPEEDUP_TARGET)
    return {"rows": rows, "comparisons": [comparison],
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "torch_threads": torch.get_num_threads()},
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}
