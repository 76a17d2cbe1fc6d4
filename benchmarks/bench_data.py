"""What data costs: ``pipeoptim prepare-data`` throughput (MB of source text per second, per worker process), byte
level and through a BPE tokenizer trained here on the same text (nothing downloaded); and at training time, the
time to draw one window's batch from a prepared folder (``train_batches.ShardBatches``: ``os.pread`` per row)
against today's in-memory path (``data.text_corpus`` + ``Corpus.batch``: the corpus as one tensor), and the
resident memory of a process holding each.

The corpus is the Python standard library's source (``data._stdlib_files``), copied into one folder. Writes
``benchmarks/results/prepare_data.csv``::

    python benchmarks/bench_data.py --mb 32 --workers 1 2
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeoptim.data import prepare_data as prep  # noqa: E402
from pipeoptim.data import token_shards as ts  # noqa: E402
from pipeoptim.data import _stdlib_files  # noqa: E402

_DRAW = textwrap.dedent("""
    import sys, time, torch
    torch.set_num_threads(1)
    kind, where, rows, seq_len, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    if kind == "prepared":
        from pipeoptim.data.batches import ShardBatches
        batches = ShardBatches(where, seed=0, seq_len=seq_len, dp_rank=0, dp=1)
    else:
        from pipeoptim.data import text_corpus
        from pipeoptim.data.batches import TextBatches
        batches = TextBatches(text_corpus(where), seed=0, seq_len=seq_len, dp_rank=0, dp=1)
    for _ in range(20):
        batches.train(rows)
    t0 = time.perf_counter()
    for _ in range(n):
        batches.train(rows)
    dt = (time.perf_counter() - t0) / n
    rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    print(dt, rss)
""")


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the workers): the machine is shared, so MB per
    CPU-second is the per-core rate, where MB per wall second also counts the time other jobs held the cores."""
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _sparse_prepared(folder: Path, train_tokens: int) -> None:
    """A prepared folder of ``train_tokens`` uint16 ids, random in the first and last MiB, a sparse hole between."""
    import json

    import numpy as np
    folder.mkdir()
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50_000, size=min(train_tokens, 1 << 19), dtype=np.uint16)
    with open(folder / "train-00000.bin", "wb") as f:
        f.write(block.tobytes())
        f.truncate(2 * train_tokens)
        f.seek(2 * train_tokens - block.nbytes)
        f.write(block.tobytes())
    (folder / "val-00000.bin").write_bytes(block[:4096].tobytes())
    shard = lambda name, n: {"file": name, "tokens": n, "sha256": "not computed"}  # noqa: E731
    (folder / ts.MANIFEST).write_text(json.dumps({
        "format": ts.FORMAT, "version": ts.FORMAT_VERSION, "dtype": "uint16",
        "tokenizer": {"name": "made up", "sha256": None, "vocab_size": 50_000, "separator": []},
        "splits": {"train": {"tokens": train_tokens, "shards": [shard("train-00000.bin", train_tokens)]},
                   "val": {"tokens": 4096, "shards": [shard("val-00000.bin", 4096)]}}}))


def _corpus(folder: Path, mb: int) -> int:
    folder.mkdir()
    total = 0
    for i, p in enumerate(_stdlib_files()):
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:8192]:
            continue
        (folder / f"{i:05d}.py.txt").write_bytes(data)
        total += len(data)
        if total >= mb << 20:
            break
    return total


def _tokenizer(path: Path, corpus: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text(errors="replace") for p in sorted(corpus.iterdir())[:300]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return tok.get_vocab_size()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=32, help="MB of stdlib source to prepare (at most what there is)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=32, help="windows per batch (a window's batch: 8 x 4 by default)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "prepare_data.csv"))
    args = p.parse_args(argv)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size = _corpus(tmp / "src", args.mb)
        vocab = _tokenizer(tmp / "tok.json", tmp / "src")
        for tokenizer in (None, str(tmp / "tok.json")):
            for w in args.workers:
                t0, c0 = time.perf_counter(), _cpu_seconds()
                m = prep.prepare(tmp / "src", tmp / "out", tokenizer, workers=w, overwrite=True, progress=False)
                wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
                tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
                rows.append({"measure": "prepare-data", "tokenizer": "bytes" if tokenizer is None else f"BPE {vocab}",
                             "workers": w, "source_mb": round(size / 1e6, 1), "tokens": tokens,
                             "seconds": round(wall, 2), "mb_per_s": round(size / 1e6 / wall, 2),
                             "mb_per_s_per_worker": round(size / 1e6 / wall / w, 2), "cpu_seconds": round(cpu, 2),
                             "mb_per_cpu_s": round(size / 1e6 / cpu, 2), "us_per_batch": "", "rss_mib": ""})
                print(rows[-1], flush=True)
        prep.prepare(tmp / "src", tmp / "out", workers=max(args.workers), overwrite=True, progress=False)
        for kind, where in (("in-memory tensor (text_corpus)", tmp / "src"), ("prepared (pread)", tmp / "out")):
            out = subprocess.run([sys.executable, "-c", _DRAW, "prepared" if "prepared" in kind else "text",
                                  str(where), str(args.rows), str(args.seq_len), str(args.draws)],
                                 capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
            dt, rss = out.stdout.split()
            rows.append({"measure": f"batch of {args.rows} x {args.seq_len}: {kind}", "tokenizer": "bytes",
                         "workers": 1, "source_mb": round(size / 1e6, 1), "tokens": "", "seconds": "",
                         "mb_per_s": "", "mb_per_s_per_worker": "", "cpu_seconds": "", "mb_per_cpu_s": "",
                         "us_per_batch": round(float(dt) * 1e6, 1), "rss_mib": round(int(rss) / 1024, 1)})
            print(rows[-1], flush=True)
        shutil.rmtree(tmp / "out")
        for name, tokens in (("1 MiB", 1 << 19), ("1 GiB", 1 << 29)):  # as tests/test_train_batches.py
            _sparse_prepared(tmp / "big", tokens)
            out = subprocess.run([sys.executable, "-c", _DRAW, "prepared", str(tmp / "big"), str(args.rows),
                                  str(args.seq_len), "200"], capture_output=True, text=True, check=True,
                                 cwd=Path(__file__).resolve().parents[1])
            dt, rss = out.stdout.split()
            rows.append({"measure": f"RSS after 200 batches, prepared corpus of {name} (sparse shard)",
                         "tokenizer": "made up (50000)", "workers": 1, "source_mb": round(2 * tokens / 1e6, 1),
                         "tokens": tokens, "seconds": "", "mb_per_s": "", "mb_per_s_per_worker": "", "cpu_seconds": "",
                         "mb_per_cpu_s": "", "us_per_batch": round(float(dt) * 1e6, 1),
                         "rss_mib": round(int(rss) / 1024, 1)})
            print(rows[-1], flush=True)
            shutil.rmtree(tmp / "big")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        f.write(f"# {machine}; AMD EPYC (AVX2), 2 cores shared with other jobs while measured (load average "
                f"{os.getloadavg()[0]:.1f} at the end); "
                f"python benchmarks/bench_data.py {' '.join(argv or sys.argv[1:])}\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
