"""Pretraining input pipeline: text sources -> WordPiece -> token shards -> packing -> MLM batches."""
from roformer.data.pipeline import BatchIterator, PretrainData, make_pretrain_data
from roformer.data.sources import TextSource, make_source
from roformer.data.tokenizer import WordPieceTokenizer, load_tokenizer

__all__ = ["BatchIterator", "PretrainData", "TextSource", "WordPieceTokenizer", "load_tokenizer",
           "make_pretrain_data", "make_source"]
