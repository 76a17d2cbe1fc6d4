"""The checks of a run's text and tokens (``data``, ``tokenizer``, a prepare-data folder), and the corpus a rank
reads: before torch is imported, a folder of ``pipeoptim prepare-data`` is checked from its manifest alone (no token
is read); plain text is read and, with a tokenizer, tokenized once to check that it fills a window in each split and
that every id has a row in the embedding.
"""
from __future__ import annotations

import os

from .config import TrainConfig

__all__: list[str] = []  # the job's own helpers


def _check_data(path: str, seq_len: int) -> dict | None:
    """ConfigError unless --data can fill a window of ``seq_len`` in each split; a folder of ``pipeoptim
    prepare-data`` returns its manifest (read from the manifest and the shards' sizes: no token is read)."""
    from ..data import DataError, check_text
    from ..errors import ConfigError
    from ..data.token_shards import SPLITS, is_prepared, read_manifest
    try:
        if is_prepared(path):
            manifest = read_manifest(path)
            counts = {s: manifest["splits"][s]["tokens"] for s in SPLITS}
            if min(counts.values()) < seq_len + 2:
                raise ConfigError(f"--data: {path} holds {counts['train']} training and {counts['val']} held-out "
                                  f"tokens, too few for one window of {seq_len} tokens and the next ({seq_len + 2} "
                                  "needed in each): prepare more text")
            return manifest
        check_text(path, seq_len)
        return None
    except DataError as e:
        raise ConfigError(f"--data: {e}") from None
    except OSError as e:
        raise ConfigError(f"--data: {path} cannot be read: {e.strerror or e}") from None


def _load_tokenizer(name: str):
    from ..data import DataError, load_tokenizer
    from ..errors import ConfigError
    try:
        return load_tokenizer(name)
    except DataError as e:
        raise ConfigError(f"--tokenizer: {e}") from None


def _corpus(cfg: TrainConfig):
    """The run's text: --data or the standard library's source, as bytes or through --tokenizer."""
    from ..data import stdlib_corpus, text_corpus
    encode = _load_tokenizer(cfg.tokenizer)[0] if cfg.tokenizer else None
    if cfg.data:
        return text_corpus(cfg.data, encode=encode)
    return stdlib_corpus(max_bytes=4 << 20, encode=encode)


def _check_tokens(cfg: TrainConfig) -> int:
    """The tokenizer's vocabulary size, after checking that the tokenized text fills a window in each split."""
    from ..errors import ConfigError
    if cfg.prepared:  # checked against the folder's manifest (_prepared_config): no text to tokenize
        return cfg.vocab_size
    vocab = _load_tokenizer(cfg.tokenizer)[1]
    corpus = _corpus(cfg)
    train, val, T = corpus.train.numel(), corpus.val.numel(), cfg.seq_len
    if min(train, val) < T + 2:
        raise ConfigError(f"--tokenizer {cfg.tokenizer}: the text makes {train} training and {val} validation "
                          f"tokens, too few for one window of {T} tokens and the next ({T + 2} needed in each); "
                          "give more text with --data")
    top = max(int(corpus.train.max()), int(corpus.val.max()))
    if top >= vocab:  # the embedding has one row per id: such an id would end in an IndexError on the first stage
        raise ConfigError(f"--tokenizer {cfg.tokenizer}: the text has token id {top}, but the tokenizer's "
                          f"vocabulary size is {vocab} (ids 0 to {vocab - 1}), which sizes the model's embedding; "
                          "the tokenizer's files disagree with each other (added tokens beyond its vocabulary?): "
                          "save it again with save_pretrained, or give its tokenizer.json")
    return vocab


def _tokenizer_identity(name: str) -> str:
    """The sha256 of a --tokenizer's files: a resume checks that the embedding rows still mean the same tokens."""
    from ..data import DataError
    from ..errors import ConfigError
    from ..data.token_shards import tokenizer_sha256
    try:
        return tokenizer_sha256(name)
    except DataError as e:
        raise ConfigError(f"--tokenizer: {e}") from None


def _prepared_config(args, manifest: dict) -> dict:
    """The run's entries for a prepare-data folder: the vocabulary of its tokens and what a checkpoint records
    of them; ConfigError when --model or --tokenizer cannot read those tokens."""
    from ..data import DataError
    from ..errors import ConfigError
    from ..data.token_shards import BYTES, data_sha256, tokenizer_sha256
    tok = manifest["tokenizer"]
    if tok["name"] == BYTES and args.tokenizer:
        raise ConfigError(f"--data {args.data} holds bytes (prepared without --tokenizer): drop --tokenizer, or "
                          f"prepare the text again with pipeoptim prepare-data --tokenizer {args.tokenizer}")
    if tok["name"] != BYTES and not args.model.startswith("hf-"):
        raise ConfigError(f"--data {args.data} holds token ids of the tokenizer {tok['name']} (vocabulary "
                          f"{tok['vocab_size']}); --model {args.model} reads bytes: use --model hf-gpt2 or hf-llama, "
                          "or prepare the text without --tokenizer")
    if tok["name"] != BYTES and args.tokenizer:
        try:
            given = tokenizer_sha256(args.tokenizer)
        except (DataError, OSError) as e:
            raise ConfigError(f"--tokenizer: {e}") from None
        if given != tok["sha256"]:
            raise ConfigError(f"--data {args.data} was prepared with the tokenizer {tok['name']} (files sha256 "
                              f"{tok['sha256'][:12]}), and --tokenizer {args.tokenizer} is another (sha256 "
                              f"{given[:12]}): drop --tokenizer (the folder needs none), or prepare the text again "
                              "with this one")
    return {"vocab_size": int(tok["vocab_size"]),
            "prepared": {"data_sha256": data_sha256(manifest), "tokenizer": tok["name"],
                         "tokenizer_sha256": tok["sha256"], "path": os.path.abspath(args.data)}}
