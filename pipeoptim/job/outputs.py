"""What ``pipeoptim train`` leaves and says: ``history.json`` and ``loss.png`` in the run directory (also after a
run ended early, from its newest checkpoint) and the summary whose last line is ``final loss: <float>``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time

from .derived import _oversubscribed, _ranks_here
from .config import TrainConfig

__all__ = ["NONFINITE_EXIT", "outputs_from_checkpoint", "report"]


NONFINITE_EXIT = 3


def _strict_json(value):
    """``value`` with every NaN and infinity as None: history.json is strict JSON (null), which any reader takes."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _replace_file(path: str, write) -> None:
    """Write ``path`` whole or not at all: ``write(f)`` into a temporary file beside it, then rename it over."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _write_outputs(run_dir: str, history: list[dict], cfg: TrainConfig) -> None:
    """history.json and loss.png of ``history`` (each replaced whole, so a reader never sees half of one)."""
    os.makedirs(run_dir, exist_ok=True)
    config = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}
    text = json.dumps(_strict_json({"config": config, "history": history}), indent=1, allow_nan=False)
    _replace_file(os.path.join(run_dir, "history.json"), lambda f: f.write(text.encode()))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from ..viz import plot_training
    fig, ax = plt.subplots(figsize=(6, 3.5))
    model = cfg.model if cfg.model.startswith("hf-") else f"{cfg.model} GPT"
    from ..data.token_shards import BYTES
    prepared = cfg.prepared  # a prepare-data folder holds tokens of its tokenizer, given or not
    unit = "nats/token" if cfg.tokenizer or (prepared and prepared["tokenizer"] != BYTES) else "nats/byte"
    plot_training(ax, history, unit=unit,
                  title=f"{model}, {cfg.stages} stages, {cfg.schedule} + {cfg.policy}, {cfg.optimizer}")
    fig.tight_layout()
    _replace_file(os.path.join(run_dir, "loss.png"), lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)


def outputs_from_checkpoint(run_dir: str, cfg: TrainConfig) -> str | None:
    """Write history.json and loss.png from the newest committed checkpoint under ``run_dir`` (the history it
    holds: what a ``--resume`` continues), whatever state the outputs were left in by a run that died; its
    directory, or None when there is none (the outputs are then left as they are). Only meta.pt is read (its
    hash checked against the manifest, then ``torch.load(weights_only=True)``), never the parts."""
    from ..runtime import checkpoint_files as files
    from ..runtime.checkpoint import read
    for _, directory in files.list_steps(os.path.join(run_dir, "checkpoint")):
        try:
            record = files.check_sizes(directory)["files"].get("meta.pt")
            if record is None or files.check_hash(directory, "meta.pt", record) is not None:
                continue
            history = read(os.path.join(directory, "meta.pt")).get("extra", {}).get("history")
        except files.CheckpointError:  # not committed, or damaged: the one before it
            continue
        if history is not None:
            _write_outputs(run_dir, history, cfg)
            return directory
    return None


def _idle_words(cfg: TrainConfig, percent: float) -> str:
    if cfg.emulate:
        return (f"idle {percent:.0f}% (--emulate: the stages run one after another, so it is not the schedule's "
                "bubble); ")
    if _oversubscribed(cfg):
        return (f"idle {percent:.0f}% ({_ranks_here(cfg)} ranks on {cfg.cores} core(s): it measures the "
                "machine, not the schedule's bubble); ")
    return f"bubble {percent:.0f}%; "


def _outputs_on_the_way_out(run_dir: str, cfg: TrainConfig) -> None:
    """After a run ended early (a signal, a dead rank): its outputs from its newest committed checkpoint. A
    second Ctrl-C while they are written leaves the ones the last checkpoint wrote, which are whole."""
    try:
        outputs_from_checkpoint(run_dir, cfg)
    except (OSError, KeyboardInterrupt) as e:
        print(f"pipeoptim train: history.json and loss.png not rewritten ({type(e).__name__}: {e}); those of the "
              "last checkpoint stay", file=sys.stderr)


def _nothing_to_do(at: int, steps: int, resume_from: str, extra: dict) -> None:
    done = extra.get("history") or [{}]
    print(f"nothing to do: step {at} of {steps} already reached ({resume_from})", file=sys.stderr)
    print(f"final loss: {done[-1].get('loss', float('nan')):.4f}")


def report(result: dict, cfg: TrainConfig, t0: float) -> int:
    """Print the run's summary and ``final loss``; the exit status (``NONFINITE_EXIT`` after a NaN stop)."""
    hist = result["history"][result.get("start", 0):]  # this run's steps: not the resumed run's
    if not hist:
        print(f"nothing to do: step {result.get('start', 0)} of {cfg.steps} already reached", file=sys.stderr)
    else:
        first, last = hist[0]["loss"], hist[-1]["loss"]
        tail = hist[-max(1, len(hist) // 10):]
        print(f"steps {hist[0]['step']}..{hist[-1]['step']}: loss {first:.4f} -> {last:.4f}; "
              f"{sum(h['tokens_per_s'] for h in tail) / len(tail):,.0f} tokens/s; "
              + _idle_words(cfg, 100 * sum(h['bubble'] for h in tail) / len(tail))
              + (f"validation loss {result['val_loss']:.4f}; " if math.isfinite(result["val_loss"]) else "")
              + f"wall {time.perf_counter() - t0:.0f} s"
              + (f" ({cfg.emulation})" if cfg.emulation else ""))
        print(f"run directory: {os.path.abspath(cfg.run_dir)} (checkpoint/, loss.png, history.json)")
    if result.get("preempted"):
        print(f"pipeoptim train: stopped by SIGTERM after step {result['preempted']} of {cfg.steps}: every rank "
              f"stopped after that step, whose checkpoint is {result['checkpoint']}; continue with --resume",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    if result.get("stopped"):
        print(f"pipeoptim train: stopped at {result['stopped']}", file=sys.stderr)
        print(f"pipeoptim train: checkpoint of the last finite state: {result['checkpoint']}; after a fix, "
              "continue with --resume (with a lower --lr or a --clip, which the resumed run applies). If the "
              "loss had been climbing, the weights have diverged and no learning rate brings them back: start "
              "again with --overwrite and a lower --lr", file=sys.stderr)
        return NONFINITE_EXIT
    print(f"final loss: {hist[-1]['loss'] if hist else float('nan'):.4f}")
    return 0
