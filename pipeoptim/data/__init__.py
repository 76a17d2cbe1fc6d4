"""What a pipeline trains on: text, tokenizers, prepared token shards and the batches of one rank.

- ``text``: corpora read in memory (the standard library's source, the user's own text, scikit-learn's digits)
  and tokenizers loaded from local files only; the names below come from it.
- ``token_shards``: a large corpus tokenized once into shards, read by index (``prepare_data``: the tokenizing,
  ``pipeoptim prepare-data``, of the units of work ``sources`` cuts a text, JSONL, Parquet or Arrow source into).
- ``batches``: the batches one rank of ``pipeoptim train`` feeds its pipeline, and their order in a checkpoint.

Importing this package loads no torch: ``pipeoptim train`` checks ``--data`` before torch is imported.
"""
from .text import (VAL_FRACTION, VOCAB_SIZE, Corpus, DataError, check_text, digits, held_out_bytes,
                   load_tokenizer, refuse_custom_code, stdlib_corpus, text_corpus, text_files)

__all__ = ["VAL_FRACTION", "VOCAB_SIZE", "Corpus", "DataError", "check_text", "digits", "held_out_bytes",
           "load_tokenizer", "refuse_custom_code", "stdlib_corpus", "text_corpus", "text_files"]
