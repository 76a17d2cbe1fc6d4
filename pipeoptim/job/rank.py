"""What every rank of ``pipeoptim train`` runs (``train_worker``): build its share of the model and the pipeline,
resume, train, evaluate, checkpoint, and stop cleanly on SIGTERM or a non-finite value.

Started by the local launcher (one process per rank, pickled by this module's path), by ``--emulate`` (once, in
this process) or by torchrun (``job.torchrun``); ``cfg`` is the ``TrainConfig`` that ``job.checks.check`` returned.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time

from .data_checks import _corpus
from .derived import (_delay_hparams, _optimizer, _oversubscribed, _policy_options, _ranks_here, _schedule_params,
                      _updates_per_window)
from .config import TrainConfig
from .run_dir import _changed_clip, resume_config
from .outputs import _write_outputs

__all__ = ["train_worker"]


def train_worker(cfg: TrainConfig) -> dict:
    """Runs on every rank (or once, emulated); returns the loss history."""
    import torch

    from ..links import parse_link, parse_straggler
    from ..models import GPTConfig, gpt_layers
    from ..models.gpt import lm_loss
    from ..train import NonFiniteError, Pipeline

    torch.manual_seed(cfg.seed)
    total_steps = cfg.steps
    sched_steps = total_steps * _updates_per_window(cfg)
    warm = max(1, sched_steps // 20)
    lr_lambda = lambda i: min(1.0, (i + 1) / warm) * max(0.1, 0.5 * (1 + math.cos(math.pi * min(i, sched_steps) / sched_steps)))  # noqa: E731
    hf = cfg.model.startswith("hf-")
    if hf:
        model_kw = _hf_model(cfg)
    else:
        mcfg = GPTConfig(seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads,
                         n_layers=cfg.n_layers)
        model_kw = dict(layers=gpt_layers(mcfg, seed=cfg.seed), loss_fn=lm_loss)
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)  # noqa: E731
    dp = cfg.dp
    pipe = Pipeline(optimizer=_optimizer(cfg), lr_scheduler=schedule,
                    devices=cfg.stages, dp=dp, schedule=cfg.schedule, policy=cfg.policy,
                    microbatches=cfg.microbatches, clip_norm=cfg.clip or None, precision=cfg.precision,
                    emulate=cfg.emulate, device=cfg.device, seed=cfg.seed, on_nonfinite=cfg.on_nonfinite,
                    watchdog_s=cfg.watchdog_s, delay_hparams=_delay_hparams(cfg),
                    policy_options=_policy_options(cfg), checkpoint_stages=cfg.checkpoint_stages or (),
                    stream=cfg.stream, schedule_options=_schedule_params(cfg) or None,
                    link=parse_link(cfg.link) if cfg.link else None,
                    straggler=parse_straggler(cfg.straggler) if cfg.straggler else None, **model_kw)
    rank = 0 if cfg.emulate else int(os.environ.get("RANK", "0"))
    from ..data.batches import for_rank
    batches = for_rank(pipe, rank, lambda: _corpus(cfg), seq_len=cfg.seq_len, seed=cfg.seed, dp=dp,
                       shards=cfg.data if cfg.prepared else None)  # read only where the first or last stage is
    history: list[dict] = []
    run_dir = cfg.run_dir
    ckpt = os.path.join(run_dir, "checkpoint")
    start = 0
    if cfg.resume_from:
        extra = pipe.load(cfg.resume_from)
        batches.restore(extra, pipe.step_count)  # the data order goes on where the checkpoint's stopped
        history = extra["history"]
        start = pipe.step_count
        changed = _apply_lr(pipe, cfg.lr, lr_lambda) if cfg.lr_given else []
        if rank == 0:
            for line in changed + _changed_clip(extra.get("config") or {}, cfg):
                print(f"pipeoptim train: {line}", file=sys.stderr)
    resumed = len(history)  # the history entries of the run(s) this one continues

    def save() -> str:
        directory = pipe.save(ckpt, extra={**batches.state(), "history": history,
                                           "config": resume_config(cfg)}, keep=cfg.keep_checkpoints)
        if rank == 0:  # the outputs follow every commit, so a run that dies leaves those of its newest checkpoint
            _write_outputs(run_dir, history, cfg)
        return directory

    B = cfg.microbatches * cfg.microbatch_size  # rows per replica; every rank draws all dp x B of them
    tokens_per_step = dp * B * cfg.seq_len
    bar = None
    idle = "idle" if _oversubscribed(cfg) or cfg.emulate else "bubble"
    if rank == 0 and not cfg.no_progress:
        from tqdm import tqdm
        if idle == "idle":
            said = _EMULATED if cfg.emulate else _OVERSUBSCRIBED
            print(f"pipeoptim train: {said.format(here=_ranks_here(cfg), **cfg.to_dict())}", file=sys.stderr)
        bar = tqdm(total=total_steps, initial=start, desc=f"{cfg.schedule}+{cfg.policy}", file=sys.stderr,
                   dynamic_ncols=True)
    val_batch = batches.val(dp * B)  # fixed; this replica's rows
    if hf:
        val_batch = (val_batch[0], val_batch[0])
    t_run = time.perf_counter()
    stopped = None
    preempted = None  # the step after which every rank stopped on SIGTERM (a checkpoint of it is written below)
    with _stop_on_sigterm(pipe):
        for step in range(start, total_steps):
            batch = batches.train(dp * B)  # this replica's rows of the global batch
            if hf:  # Hugging Face's loss takes the input ids as labels and shifts them itself
                batch = (batch[0], batch[0])
            t0 = time.perf_counter()
            try:
                loss = pipe.train_step(batch)
            except NonFiniteError as e:  # raised on every rank at this same step
                stopped = str(e)
                loss = pipe.last_stats["loss"]
            dt = time.perf_counter() - t0
            st = pipe.last_stats
            history.append({"step": step + 1, "loss": loss, "tokens_per_s": tokens_per_step / dt,
                            "bubble": st["bubble"], "grad_norm": st["grad_norm"], "skipped": st.get("nonfinite", 0),
                            "val_loss": None})
            if stopped:
                break
            if st.get("stop") and step + 1 < total_steps:  # agreed by every rank at this same step
                preempted = step + 1
                if bar is not None:
                    bar.write(f"step {step + 1}: SIGTERM: stopping with a checkpoint of this step")
                break
            if step + 1 == total_steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                history[-1]["val_loss"] = pipe.eval_step(val_batch)
            if bar is not None:
                if not math.isfinite(loss) or st.get("nonfinite"):
                    bar.write(f"step {step + 1}: NaN or inf (loss {loss:.4g}); {st.get('nonfinite', 0)} update(s) "
                              "skipped (--on-nonfinite skip)")
                bar.set_postfix({"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_step / dt:,.0f}",
                                 idle: f"{st['bubble'] * 100:.0f}%",
                                 **({"emulated": cfg.emulation.removeprefix("emulated: ")}
                                    if cfg.emulation else {})})
                bar.update(1)
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < total_steps:
                save()
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t_run
        val = float("nan")
        if not stopped and history and history[-1].get("val_loss") is not None:
            val = history[-1]["val_loss"]
        # a resume with nothing left to do writes nothing (the checkpoint it came from is already this state);
        # still inside: a second SIGTERM (a scheduler's, after the agent's) must not end a rank mid-save
        directory = save() if start < total_steps else cfg.resume_from
    return {"history": history, "val_loss": val, "elapsed": elapsed, "rank": rank, "stopped": stopped,
            "checkpoint": directory, "start": resumed, "preempted": preempted}


@contextlib.contextmanager
def _stop_on_sigterm(pipe):
    """While inside, SIGTERM asks the job to stop (``Pipeline.request_stop``) instead of ending this process:
    every rank then stops after the same step and the run saves a checkpoint of it. A cluster's scheduler sends
    SIGTERM some time before it kills a job; the launcher and torchrun's agent pass it on to every rank. Outside
    (and off the main thread, where Python cannot take signals), SIGTERM keeps its previous meaning."""
    import threading

    from ..runtime.launcher import sigterm_received
    if sigterm_received():  # it came while the stages were being built (the launcher's workers record it)
        pipe.request_stop()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: pipe.request_stop())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_OVERSUBSCRIBED = ("{here} ranks share {cores} CPU core(s): the progress bar's 'idle' is each rank's idle share, "
                   "which here includes waiting for a core, so it measures the machine more than the schedule's "
                   "bubble (pipeoptim schedule NAME -D {stages} -N {microbatches} gives the schedule's own)")
_EMULATED = ("--emulate runs the {stages} stages one after another in this process: the progress bar's 'idle' is "
             "each stage's share of waiting for the others (about 1 - 1/{stages}), not the schedule's bubble "
             "(pipeoptim schedule {schedule} -D {stages} -N {microbatches} gives that)")


def _apply_lr(pipe, lr: float, lr_lambda) -> list[str]:
    """After a resume: make ``lr`` the peak of the learning-rate schedule, which the checkpoint restored with
    the old run's peak; the schedule continues at its step. Param groups with another peak (Muon's AdamW
    groups) keep theirs. Returns what changed, in words."""
    old = None
    for w in pipe.workers:
        for st in w.stages.values():
            outer = st.scheduler
            sched = getattr(outer, "inner", outer)  # delay-aware hyper-parameters wrap the LR schedule
            old = sched.base_lrs[0] if old is None else old
            if old == lr:
                continue
            undelayed = []
            for i, group in enumerate(st.optimizer.param_groups):
                if sched.base_lrs[i] == old:
                    sched.base_lrs[i] = group["initial_lr"] = lr
                undelayed.append(sched.base_lrs[i] * lr_lambda(sched.last_epoch))
            sched._last_lr = undelayed
            if outer is sched:
                for group, value in zip(st.optimizer.param_groups, undelayed):
                    group["lr"] = value
            else:  # the wrapper holds the undelayed lr and applies this stage's factor to it
                outer._lr = undelayed
                outer._apply()
    if old is None or old == lr:
        return []
    return [f"--lr {lr:g} applies from step {pipe.step_count} on: the checkpoint was written with --lr {old:g} "
            "(the learning-rate schedule goes on from where it was, with the new peak)"]


def _hf_model(cfg: TrainConfig) -> dict:
    """Pipeline arguments for a Hugging Face model of the configured size, built on meta (no memory: each rank
    materialises its own stages from the seed)."""
    import torch

    from ..models.hf import byte_level_config, causal_lm_layers
    from ..runtime.config import make_schedule
    if cfg.hf_spec:  # --hf-config: the user's model, checked by _config
        from ..models.hf_config import build
        model = build(cfg.hf_spec)
    else:
        config, cls = byte_level_config(cfg.model.removeprefix("hf-"), d_model=cfg.d_model,
                                        n_heads=cfg.n_heads, n_layers=cfg.n_layers, seq_len=cfg.seq_len)
        config.vocab_size = cfg.vocab_size  # the tokenizer's (--tokenizer), else 256 bytes
        with torch.device("meta"):
            model = cls(config)
    cut = causal_lm_layers(model)
    synchronous = make_schedule(cfg.schedule, cfg.stages, cfg.microbatches).synchronous
    return dict(layers=cut.layers, loss_fn=cut.loss_fn, init_fn=cut.init_fn,
                **({"tied": cut.tied} if synchronous else {"copies": cut.tied}))
