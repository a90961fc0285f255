"""Data command line: fill the token cache ahead of training; train or try a tokenizer.

  python -m roformer.data prepare --config=configs/rotary.py --config.data.source=files \\
      --config.data.files='corpus/*.txt' [--processes=4]
  python -m roformer.data tokenizer train --source files --files 'corpus/*.txt' --vocab-size 8000 --out vocab_dir
  python -m roformer.data tokenizer encode --vocab vocab_dir "Some text to look at"

`prepare` builds the cache entry (trained tokenizer, token shards) that a pretraining
or ablation run with the same config reads, so the run starts without tokenizing.
`--processes=K` splits the work over K local processes. On several hosts sharing
data.cache_dir, run it on every host with `--process_index=I --process_count=N`, or
with the config's `distributed` section set as for training: each host tokenizes
its share of the files (with `--processes=K` too, in K processes).

`tokenizer train` learns a BERT-style WordPiece vocabulary ([PAD] [UNK] [CLS] [SEP]
[MASK] first) on any data source and writes OUT/tokenizer.json and OUT/vocab.txt;
either file works as `--config.data.vocab`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from roformer import cli
from roformer.data.config import DataConfig
from roformer.data.prepare import prepare, prepare_locally
from roformer.data.sources import FILE_FORMATS, SOURCES, make_source
from roformer.data.tokenizer import WordPieceTokenizer, load_tokenizer

FLAGS = flags.FLAGS

# DataConfig fields that choose and read a text source (flags of `tokenizer train`).
SOURCE_FIELDS = ("source", "files", "file_format", "hf_path", "hf_name", "hf_split", "hf_text_column",
                 "hf_streaming", "tfds_name", "tfds_split", "tfds_data_dir", "tfds_text_key")
CHOICES = {"source": SOURCES, "file_format": FILE_FORMATS}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    command = argv[1] if len(argv) > 1 else ""
    if command in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    if command == "tokenizer":
        with cli.user_errors():   # a bad file or vocabulary is one line, as in the other commands
            return tokenizer_main(argv[2:])
    if command == "prepare":
        # defined here, not on import, so that importing this module defines no absl flags
        config_flags.DEFINE_config_file("config", None, "Pretraining or ablation config file "
                                        "(configs/*.py[:arg]).", lock_config=True)
        flags.DEFINE_integer("processes", 1, "Local processes to split this host's work over.")
        flags.DEFINE_integer("process_index", -1, "This host's index among --process_count hosts.")
        flags.DEFINE_integer("process_count", -1, "Hosts sharing data.cache_dir that split the work; -1: from "
                                                  "the config's distributed section, or 1.")
        flags.mark_flag_as_required("config")
        prepare_argv = [f"{argv[0]} prepare", *argv[2:]]
        cli.resolve_config_arg(prepare_argv)
        spec = cli.config_spec(prepare_argv)
        with cli.user_errors():   # as the other commands: a missing config file is one line
            if spec is not None and not Path(spec.partition(":")[0]).is_file():
                raise cli.UsageError(f"--config={spec}: no such config file {spec.partition(':')[0]}")
            if cli.asks_for_help(prepare_argv):   # the flags and config keys, exit 0
                print(cli.help_text(__doc__, spec or str(cli.CONFIG_DIR / "base.py"), given=spec is not None))
                return 0
        with cli.user_errors():
            app.run(_prepare_main, argv=prepare_argv)
    print(__doc__, file=sys.stderr)
    return 2


# ---------------------------------------------------------------- prepare

def _prepare_main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    config = FLAGS.config.pretrain if "pretrain" in FLAGS.config else FLAGS.config   # an ablation config
    data = DataConfig.from_mapping(config.data)
    if config.train.init_from:   # a warm start reads its checkpoint's tokenizer
        # imported here: flax and orbax load only for a warm start, not for every data command
        from roformer.checkpoint_source import CheckpointSource

        source = CheckpointSource.find(config.train.init_from, config.train.init_step, what="train.init_from")
        data = source.with_tokenizer(data)
    index, count = _process_index_and_count(config)
    if FLAGS.processes > 1:
        summary = prepare_locally(data, FLAGS.processes, host_index=index, host_count=count)
    else:
        summary = prepare(data, process_index=index, process_count=count)
    print(json.dumps(summary))
    print(f"done: {summary['documents']:,} documents, {summary['tokens']:,} tokens in the cache entry "
          f"{summary['shards']}", flush=True)


def _process_index_and_count(config) -> tuple[int, int]:
    if FLAGS.process_count > 0:
        if not 0 <= FLAGS.process_index < FLAGS.process_count:
            raise app.UsageError(f"--process_index={FLAGS.process_index} must be in [0, --process_count="
                                 f"{FLAGS.process_count})")
        return FLAGS.process_index, FLAGS.process_count
    dist = config.distributed
    if dist.enabled or dist.coordinator_address:    # the same processes as the training job
        # imported here: jax loads only for a multi-host job, not for every data command
        import jax

        from roformer.distributed import initialize_distributed

        initialize_distributed(dist)
        return jax.process_index(), jax.process_count()
    return 0, 1


# ---------------------------------------------------------------- tokenizer

def build_tokenizer_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m roformer.data tokenizer",
                                     description="Train a WordPiece vocabulary on a data source, or encode text.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a WordPiece vocabulary on a data source")
    defaults = DataConfig()
    for field in SOURCE_FIELDS:   # the data settings' own names and defaults
        default = getattr(defaults, field)
        flag = "--" + field.replace("_", "-")
        if isinstance(default, bool):
            train.add_argument(flag, action="store_true")
        else:
            train.add_argument(flag, default=default, choices=CHOICES.get(field))
    train.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--cased", action="store_true", help="keep case and accents (default: lowercase)")
    train.add_argument("--out", required=True, help="directory for tokenizer.json and vocab.txt")
    encode = commands.add_parser("encode", help="print the tokens and ids of some text")
    encode.add_argument("--vocab", required=True, help="vocab.txt, tokenizer.json or a directory with one")
    encode.add_argument("--cased", action="store_true", help="for a cased vocab.txt")
    encode.add_argument("text", nargs="+")
    return parser


def tokenizer_main(argv: list[str]) -> int:
    args = build_tokenizer_parser().parse_args(argv)
    if args.command == "train":
        source = make_source(DataConfig(**{field: getattr(args, field) for field in SOURCE_FIELDS}))
        tokenizer = WordPieceTokenizer.train(source.documents(), vocab_size=args.vocab_size,
                                             lowercase=not args.cased, min_frequency=args.min_frequency)
        path = tokenizer.save(args.out)
        print(f"wrote {path} and {path.parent / 'vocab.txt'} ({tokenizer.vocab_size} tokens) from {source}")
    else:
        tokenizer = load_tokenizer(args.vocab, lowercase=not args.cased)
        encoding = tokenizer.encode(" ".join(args.text))
        print(json.dumps({"tokens": encoding.tokens, "ids": encoding.ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
