"""Pretraining input pipeline: text sources -> WordPiece -> token shards -> packing -> MLM batches."""
from roformer.data.config import DataConfig
from roformer.data.pipeline import BatchIterator, PretrainData, make_pretrain_data, prepare_corpus
from roformer.data.sources import TextSource, make_source
from roformer.data.tokenizer import WordPieceTokenizer, load_tokenizer

__all__ = ["BatchIterator", "DataConfig", "PretrainData", "TextSource", "WordPieceTokenizer", "load_tokenizer",
           "make_pretrain_data", "make_source", "prepare_corpus"]
