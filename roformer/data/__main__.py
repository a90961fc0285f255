"""Data command line: fill the token cache ahead of training; train or try a tokenizer.

  python -m roformer.data prepare --config=configs/rotary.py --config.data.source=files \\
      --config.data.files='corpus/*.txt' [--processes=4]
  python -m roformer.data tokenizer train --source=files --files='corpus/*.txt' --vocab-size=8000 --out=vocab_dir
  python -m roformer.data tokenizer encode --vocab=vocab_dir "Some text to look at"

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

import json
import sys

from absl import flags
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


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    """The command (`prepare` or `tokenizer`) is the first of `argv` (without the program name)."""
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    if command in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    if command == "tokenizer":
        return tokenizer_main(argv[1:])
    if command == "prepare":
        # defined here, not on import, so that importing this module defines no absl flags
        config_flags.DEFINE_config_file("config", None, "Pretraining or ablation config file "
                                        "(configs/*.py[:arg]).", lock_config=True)
        flags.DEFINE_integer("processes", 1, "Local processes to split this host's work over.")
        flags.DEFINE_integer("process_index", -1, "This host's index among --process_count hosts.")
        flags.DEFINE_integer("process_count", -1, "Hosts sharing data.cache_dir that split the work; -1: from "
                                                  "the config's distributed section, or 1.")
        flags.mark_flag_as_required("config")
        sys.argv[1:] = argv[1:]   # the flags after the command, as cli.run reads them
        cli.run(_prepare_main, doc=__doc__, help_config=cli.CONFIG_DIR / "base.py")
    raise cli.UsageError(f"give a command, prepare or tokenizer (see --help); got {command!r}" if command
                         else "give a command, prepare or tokenizer (see --help)")


# ---------------------------------------------------------------- prepare

def _prepare_main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
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
            raise cli.UsageError(f"--process_index={FLAGS.process_index} must be in [0, --process_count="
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

TOKENIZER_USAGE = """python -m roformer.data tokenizer train --source=files --files='corpus/*.txt' --vocab-size=8000 --out=DIR
python -m roformer.data tokenizer encode --vocab=DIR "Some text to look at"

`train` learns a WordPiece vocabulary on a data source; `encode` prints the tokens and ids of some text."""


def tokenizer_flags(command: str) -> cli.CommandFlags:
    """The flags of `tokenizer train` (the data settings' own names and defaults) or `tokenizer encode`."""
    flags_ = cli.CommandFlags(TOKENIZER_USAGE)
    if command == "encode":
        flags_.define("--vocab", required=True, help="vocab.txt, tokenizer.json or a directory with one")
        flags_.define("--cased", type=bool, help="for a cased vocab.txt")
        return flags_
    defaults = DataConfig()
    for field in SOURCE_FIELDS:
        default = getattr(defaults, field)
        flags_.define("--" + field.replace("_", "-"), default=default, choices=CHOICES.get(field),
                      type=bool if isinstance(default, bool) else str)
    flags_.define("--vocab-size", type=int, default=defaults.vocab_size)
    flags_.define("--min-frequency", type=int, default=2)
    flags_.define("--cased", type=bool, help="keep case and accents (default: lowercase)")
    flags_.define("--out", required=True, help="directory for tokenizer.json and vocab.txt")
    return flags_


def tokenizer_main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command not in ("train", "encode"):
        if cli.asks_for_help(["", *argv]):
            print(TOKENIZER_USAGE)
            return 0
        raise cli.UsageError("tokenizer: give a command, train or encode (see --help)")
    args, text = tokenizer_flags(command).parse(argv[1:])
    if command == "train":
        if text:
            raise cli.UsageError(f"tokenizer train: unexpected arguments {text}")
        source = make_source(DataConfig(**{field: getattr(args, field) for field in SOURCE_FIELDS}))
        tokenizer = WordPieceTokenizer.train(source.documents(), vocab_size=args.vocab_size,
                                             lowercase=not args.cased, min_frequency=args.min_frequency)
        path = tokenizer.save(args.out)
        print(f"wrote {path} and {path.parent / 'vocab.txt'} ({tokenizer.vocab_size} tokens) from {source}")
    else:
        if not text:
            raise cli.UsageError("tokenizer encode: give the text to encode")
        tokenizer = load_tokenizer(args.vocab, lowercase=not args.cased)
        encoding = tokenizer.encode(" ".join(text))
        print(json.dumps({"tokens": encoding.tokens, "ids": encoding.ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
