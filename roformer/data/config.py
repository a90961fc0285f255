"""`DataConfig`: every setting of the pretraining data, each default in one place.

The config files build their `data` section from it (`configs/base.py`); code that
reads a config converts that section once with `DataConfig.from_mapping(config.data)`.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from roformer.errors import ConfigError
from roformer.settings import check_all

MIN_SEQ_LEN = 8   # the shortest row the pipeline packs ([CLS], [SEP] and a few tokens)
# What each numeric or yes/no setting allows (roformer.settings); the sources check their own names.
RULES = {
    "vocab_size": "int >= 1", "mask_rate": "float in (0, 1)", "max_predictions_per_seq": "int >= 0",
    "heldout_fraction": "float in [0, 1)", "num_workers": "int >= 0", "lowercase": "bool",
    "hf_streaming": "bool", "whole_word_masking": "bool", "train_while_building": "choice auto on off",
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "embedded"        # embedded | files | hf | tfds (see sources.py)
    files: str = ""                 # files: a glob (or a list of globs) of text / WikiExtractor files
    file_format: str = "auto"       # files: auto | text | wikiextractor
    hf_path: str = ""               # hf: dataset name or a save_to_disk directory
    hf_name: str = ""
    hf_split: str = "train"
    hf_text_column: str = "text"
    hf_streaming: bool = False
    hf_data_files: Any = ""
    tfds_name: str = ""             # tfds: builder name, e.g. wikipedia/20230601.en
    tfds_split: str = "train"
    tfds_data_dir: str = ""
    tfds_text_key: str = "text"
    vocab: str = ""                 # vocab.txt / tokenizer.json / a directory; "" = train one on the source
    vocab_size: int = 8000          # size of that trained vocabulary
    lowercase: bool = True
    cache_dir: str = ""             # "" = $ROFORMER_CACHE or ~/.cache/roformer-jax
    packing: str = "packed"         # packed | document
    mask_rate: float = 0.15
    max_predictions_per_seq: int = 0    # 0 = round(mask_rate * seq_len) + 1
    whole_word_masking: bool = False
    heldout_fraction: float = 0.02
    num_workers: int = 0            # encoding threads per process (0 = every core); the Rust encoder
                                    # also spreads each chunk over the cores (RAYON_NUM_THREADS caps it)
    train_while_building: str = "auto"  # on: train on the token cache's finished shards while the rest
                                    # tokenize (roformer.data.streaming); auto: on for a streaming source

    @property
    def trains_while_building(self) -> bool:
        """Whether a run reads its corpus in the streamed order while the cache builds."""
        if self.train_while_building == "auto":
            return self.source == "hf" and self.hf_streaming
        return self.train_while_building == "on"

    def __post_init__(self) -> None:
        check_all("data.", self, RULES)
        # Numbers enter the stream ids as JSON, so 0 and 0.0 must not give different ids.
        for field in dataclasses.fields(self):
            kind = {"int": int, "float": float, "bool": bool}.get(field.type)
            if kind is not None:
                object.__setattr__(self, field.name, kind(getattr(self, field.name)))

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> "DataConfig":
        """A config's `data` section (ConfigDict or dict); an unknown key is an error naming it."""
        items = section.to_dict() if hasattr(section, "to_dict") else dict(section)
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = [key for key in items if key not in known]
        if unknown:
            hints = [f"data.{key}" + (f" (did you mean data.{close[0]}?)" if (close := difflib.get_close_matches(
                key, known, n=1)) else "") for key in unknown]
            raise ConfigError(f"unknown data setting(s): {', '.join(hints)}; the data settings are {known}")
        return cls(**items)


def without_neutral_settings(section: Mapping[str, Any]) -> dict:
    """A data section (as a dict) less the settings added after runs were recorded that, at
    their value in it, leave a run computing what it did before they existed: fingerprints of
    recorded runs (ablation stages, study arms) leave them out, so those runs stay current."""
    section = dict(section)
    if not DataConfig.from_mapping(section).trains_while_building:   # the order of a built cache
        section.pop("train_while_building", None)
    return section
