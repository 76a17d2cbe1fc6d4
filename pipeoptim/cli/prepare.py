"""``pipeoptim prepare-data SRC OUT``: tokenize a corpus once into token shards that ``pipeoptim train --data OUT``
reads by index (``pipeoptim.data.token_shards``), so no rank holds the corpus in memory or tokenizes it again.

SRC: a text file or a folder of text files (the last 5% of every file held out, as ``train --data`` holds it out),
JSONL or Parquet files (or a folder of one kind), or a folder written by a Hugging Face dataset's
``save_to_disk`` (a record's text in ``--text-field``; 1 record in 20 held out, by the hash of its text). OUT is
written under a temporary name beside it and renamed when complete. Exit status: 0 done, 2 invalid input (said
before anything is written).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .arg_types import positive_int as _positive_int

__all__ = ["add_arguments", "run"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("source", metavar="SRC",
                   help="a text file, a folder of text files, .jsonl or .parquet files, or a datasets save_to_disk "
                        "folder")
    p.add_argument("out", metavar="OUT", help="the folder to write (new, or empty; or an earlier one with --overwrite)")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="a local tokenizer (a tokenizer.json, a folder saved with save_pretrained, or a name in the "
                        "Hugging Face cache; nothing is downloaded, no code from the folder runs) (default: bytes, "
                        "vocabulary 256)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSONL, Parquet and datasets sources: the field holding each record's text")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="processes that tokenize (default: with --tokenizer the cores this process may use; without, "
                        "1: bytes need no tokenizing, and more workers only add their start and the transfer, "
                        "docs/guide/data.md)")
    p.add_argument("--shard-tokens", type=_positive_int, default=None, metavar="N",
                   help="tokens per shard file (default: 2^28, 512 MiB of uint16)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT, an earlier prepared folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    from ..data import DataError
    from ..data.prepare_data import prepare
    from ..data.token_shards import DEFAULT_SHARD_TOKENS
    workers = args.workers or (_cores() if args.tokenizer else 1)
    t0 = time.perf_counter()
    try:
        m = prepare(args.source, args.out, args.tokenizer, text_field=args.text_field, workers=workers,
                    overwrite=args.overwrite, progress=not args.no_progress,
                    shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS)
    except DataError as e:
        print(f"pipeoptim prepare-data: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    mb = m["source"]["bytes"] / 1e6  # of the source files (compressed, for Parquet)
    tr, va = m["splits"]["train"], m["splits"]["val"]
    print(f"{args.out}: {tr['tokens']:,} training and {va['tokens']:,} held-out tokens of {m['tokenizer']['name']} "
          f"(vocabulary {m['tokenizer']['vocab_size']}, {m['dtype']}) in {len(tr['shards']) + len(va['shards'])} "
          f"shard(s), from {mb:,.3f} MB of {m['source']['kind']} in {wall:.1f} s ({mb / wall:,.2f} MB/s with "
          f"{workers} worker(s)); train on it with pipeoptim train --data {args.out}")
    return 0


def main(argv=None) -> int:
    from .help import HelpFormatter
    p = add_arguments(argparse.ArgumentParser(prog="pipeoptim prepare-data", description=__doc__,
                                              formatter_class=HelpFormatter, allow_abbrev=False))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
