"""Tokenizer command line.

  python -m roformer.tokenizer train --source files --files 'corpus/*.txt' --vocab-size 8000 --out vocab_dir
  python -m roformer.tokenizer encode --vocab vocab_dir "Some text to look at"

`train` learns a BERT-style WordPiece vocabulary ([PAD] [UNK] [CLS] [SEP] [MASK]
first) on any data source and writes OUT/tokenizer.json and OUT/vocab.txt; either
file works as `--config.data.vocab`.
"""
from __future__ import annotations

import argparse
import json
import sys

from roformer.data.sources import FILE_FORMATS, SOURCES, make_source
from roformer.data.tokenizer import WordPieceTokenizer, load_tokenizer


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=SOURCES, default="embedded")
    parser.add_argument("--files", default="", help="glob of text / WikiExtractor files (source=files)")
    parser.add_argument("--file-format", choices=FILE_FORMATS, default="auto")
    parser.add_argument("--hf-path", default="")
    parser.add_argument("--hf-name", default="")
    parser.add_argument("--hf-split", default="train")
    parser.add_argument("--hf-text-column", default="text")
    parser.add_argument("--hf-streaming", action="store_true")
    parser.add_argument("--tfds-name", default="")
    parser.add_argument("--tfds-split", default="train")
    parser.add_argument("--tfds-data-dir", default="")
    parser.add_argument("--tfds-text-key", default="text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m roformer.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a WordPiece vocabulary on a data source")
    _add_source_args(train)
    train.add_argument("--vocab-size", type=int, default=8000)
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--cased", action="store_true", help="keep case and accents (default: lowercase)")
    train.add_argument("--out", required=True, help="directory for tokenizer.json and vocab.txt")
    encode = commands.add_parser("encode", help="print the tokens and ids of some text")
    encode.add_argument("--vocab", required=True, help="vocab.txt, tokenizer.json or a directory with one")
    encode.add_argument("--cased", action="store_true", help="for a cased vocab.txt")
    encode.add_argument("text", nargs="+")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        source = make_source({k: v for k, v in vars(args).items()})
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
