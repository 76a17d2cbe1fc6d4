"""The user-facing pipeline: give layers (or stages), an optimizer factory, a schedule and a weight policy by
name; call ``train_step(batch)`` on every rank.

    pipe = Pipeline(gpt_layers(cfg), loss_fn=lm_loss, devices=4, schedule="async-1f1b", policy="pipeoptim",
                    microbatches=8, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss = pipe.train_step((tokens, targets))      # same value on every rank

- Model: a list/``nn.Sequential`` of layers plus ``balance`` (layers per stage; default even, or
  ``balance="time"`` to profile and balance with ``sample=``), or ``stages=[module, ...]`` one per stage, or a
  factory ``stages=lambda stage_index: module`` called only for this process's stages (``model_cut``).
  Parameters get global names (``<layer>.<param>``) that do not depend on the balance, so checkpoints load
  into another balance.
- Large models: build the model on the ``meta`` device; each process materialises and initialises only the
  layers of its own stages, deterministically from ``seed`` and each layer's global name (``init_fn(layer)``
  or the submodules' ``reset_parameters``; see ``materialize``). Real layers are trained in place, not copied.
- ``dp=2``: two data-parallel replicas of the pipeline in a job of ``dp x devices`` ranks (rank = replica x
  devices + pipeline device); each rank passes its replica's own batch (``runtime.data_parallel.replica_rows``)
  and the replicas average their gradients (synchronous: the update of one pipeline on their batches
  concatenated; asynchronous: each stage's step averages that step's gradient over the replicas). The loss
  returned is the mean over every replica's micro-batches (``runtime.data_parallel`` says it all).
- ``emulate=True`` runs every device in this process (``runtime.Emulator``) on ``device`` ('cpu' or 'cuda':
  all stages on that one device); otherwise this process is one rank of a torch.distributed job (torchrun
  or ``runtime.launch``) and builds only its own chunks.
- The loss is scaled once (``Plan.loss_scale``); ``clip_norm`` clips by the global norm over the pipeline
  (synchronous schedules; per stage for asynchronous ones, see executor); ``precision="bf16"`` runs bf16
  working weights under autocast over fp32 master weights.
- ``checkpoint_stages`` recomputes activations in the backward, under every weight policy: ``True`` (every stage),
  stage indices, or ``{stage: "all" | [layer indices within the stage]}`` (``recompute``). The recomputation
  reads the weights the policy's backward reads (stash/2bw: the forward's version; pipeoptim: the real weights
  then, or ``policy_options=dict(recompute_on="forward")`` for the forward's prediction; see ``policies.base``).
- ``measure_activations=True`` counts, per stage, the most bytes forwards in flight saved for their backwards
  (``policy.peak_activation_bytes``); off by default, as it costs a Python call per saved tensor.
- ``tied=[("0.tok.weight", "7.lm.weight")]``: parameters held on several stages that are one weight (tied
  embeddings). Copies start from the first name's value; before each step every copy's gradient becomes the
  sum over the copies (synchronous schedules only; see ``runtime.tied``); the global norm counts it once.
  ``copies=[(source, copy)]``: the copy starts from the source's value and then trains as its own weight
  (what tied embeddings become under an asynchronous schedule; see ``copies``).
- ``save(dir)`` / ``load(dir)``: model, optimizer, LR scheduler and policy state per global parameter name,
  written atomically as ``dir/step-<n>/`` with a manifest of hashes; ``load`` takes the newest intact one
  (``runtime.checkpoint``, ``runtime.checkpoint_files``).
- A NaN or inf loss or gradient is found on every rank at the same ``train_step``; no update with a non-finite
  gradient is ever applied. ``on_nonfinite="stop"`` (default) then raises ``NonFiniteError`` on every rank
  (the weights hold the last finite state: save them); ``"skip"`` drops those updates and goes on.
- ``optimizer`` may return a list of optimizers over the stage's parameters (e.g. ``optim.muon_and_adamw()``:
  torch.optim.Muon for the matrices, AdamW for the rest); they are stepped as one (``optim.ChainedOptimizer``).
- ``delay_hparams=dict(lr="pipemare", momentum="nesterov", warmup=64)`` (asynchronous schedules): each stage's
  lr and momentum as functions of its delay, with a warm-up in updates (``delay``; the formulas are there).
- ``watchdog_s``: how long a rank may make no progress inside the pipeline before the job ends, naming the
  rank that holds it up (``runtime.watchdog``; default ``max(300 s, 20 x the slowest step)``). Building the
  pipeline and ``load`` are watched too, as is the rendezvous before them (``PIPEOPTIM_WATCHDOG_S``).
- A batch is refused before anything runs when it is empty or its inputs and targets differ in row count.
- ``stream=True`` (``async-1f1b``, ``2bw``): the micro-batches in flight when a ``train_step`` has run its
  window's last forward stay in flight into the next call, so the pipeline fills once and never drains
  between windows, as the asynchronous papers run it (``runtime.stream``). K calls and ``drain()`` apply
  exactly the updates of one call on K x N micro-batches. ``eval_step``, ``state_dict``, ``save`` and
  ``load`` drain first; each call's loss is its own window's. Faster per step, it learns less per update: more
  of its micro-batches meet the full staleness (``benchmarks/bench_stream_convergence.py``), so it is off by
  default.
- Emulation for benchmarks (multi-process CPU jobs only): ``link=`` a ``links.Link`` delays every point-to-point
  message by latency + bytes / bandwidth (``runtime.comm``), ``straggler=(device, factor)`` slows that pipeline
  device's compute by the factor (``runtime.worker``). Their numbers are an emulation's, not a network's.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from .delay import DelayAwareHParams, DelayRules, stage_delays
from .optim import as_optimizer
from .policies import make_policy
from .runtime.config import check_policy, make_schedule, stages_for
from .runtime.cpu_memory import keep_freed_memory
from .runtime.data_parallel import check_dp, devices_per_replica
from .runtime.emulator import Emulator, emulated_device
from .runtime.executor import Executor
from .runtime.microbatches import split_batch
from .runtime.plan import ConfigError, Plan
from .runtime.stream import Stream
from .runtime.tied import check_ties, plan_ties
from .runtime.watchdog import COLLECTIVE
from .runtime.worker import DeviceWorker, StageRuntime
from .schedules.actions import Chunk
from .stages.copies import check_copies, copy_starts
from .stages.balance import choose_balance
from .stages.model_cut import ModelCut, StageModule, as_layers
from .stages.recompute import parse_checkpoint_stages

__all__ = ["Pipeline", "StageModule", "NonFiniteError", "NONFINITE_POLICIES"]

NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(ArithmeticError):
    """Raised by ``train_step`` on every rank, at the same step, when the loss or a gradient was NaN or inf
    under ``on_nonfinite="stop"``; the updates with non-finite gradients were not applied."""


BUILDING = "building its stages (Pipeline start-up)"
BUILT = "the collectives that build a Pipeline (copies, process groups)"


def _idle_when_built(init):
    """Building a distributed ``Pipeline`` is watched: its collectives like a step's (a rank that freezes or
    never gets there is named within the watchdog's bound), its own work only shown in the rank's heartbeat
    (``Watchdog.working``: slow imports or initialisation never trip it); however ``__init__`` ends, the rank
    is then outside the pipeline."""
    @functools.wraps(init)
    def build(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        finally:
            if getattr(self, "_watch", None) is not None:
                self._watch.idle()
    return build


class Pipeline:
    @_idle_when_built
    def __init__(self, layers: Sequence[nn.Module] | nn.Sequential | None = None, *, loss_fn: Callable,
                 optimizer: Callable[[object], torch.optim.Optimizer], devices: int | None = None,
                 stages: Sequence[nn.Module] | Callable[[int], nn.Module] | None = None,
                 balance: Sequence[int] | str | None = None, sample=None, schedule: str = "1f1b",
                 policy: str | None = None, microbatches: int = 4, lr_scheduler: Callable | None = None,
                 schedule_options: dict | None = None, policy_options: dict | None = None,
                 clip_norm: float | None = None, precision: str = "fp32",
                 checkpoint_stages: Sequence[int] | dict | bool = (),
                 emulate: bool = False, device: str = "cpu", dp: int = 1, tied: Sequence[Sequence[str]] = (),
                 copies: Sequence[tuple[str, str]] = (), seed: int = 0,
                 init_fn: Callable[[nn.Module], None] | None = None, on_nonfinite: str = "stop",
                 watchdog_s: float | None = None, delay_hparams: DelayRules | dict | None = None,
                 measure_activations: bool = False, stream: bool = False, link=None,
                 straggler: tuple[int, float] | None = None):
        if (layers is None) == (stages is None):
            raise ConfigError("give the model either as layers= (with an optional balance) or as stages= (one "
                              "module per stage, or a factory stage_index -> module), not both and not neither")
        if precision not in ("fp32", "bf16"):
            raise ConfigError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {on_nonfinite!r}")
        if watchdog_s is not None and not (isinstance(watchdog_s, (int, float)) and 0 < watchdog_s < math.inf):
            raise ConfigError(f"watchdog_s must be a positive number of seconds, got {watchdog_s!r}")
        dp = check_dp(dp, emulate)
        if link is not None and device != "cpu":
            raise ConfigError(f"link= delays the messages of CPU processes (gloo); on device={device!r} the transfers "
                              "are NCCL's own. Use device='cpu' with link=")
        if emulate and (link is not None or straggler is not None):
            raise ConfigError("link= and straggler= emulate a network and a slow device between processes; "
                              "emulate=True runs every stage in one process. Drop emulate=True")
        if layers is not None:
            layers = as_layers(layers)
        self.emulate, self.clip_norm, self.loss_fn = emulate, clip_norm, loss_fn
        self.on_nonfinite, self.nonfinite_steps = on_nonfinite, 0
        self.loaded_from: str | None = None
        ctx = None
        self._watch = None
        if emulate:
            tdev = emulated_device(device)
        else:
            from .runtime.dist_env import init_from_env
            ctx = init_from_env(device)
            tdev = ctx.device
            self._watch = ctx.watch
            if self._watch is not None:
                if watchdog_s is not None:
                    self._watch.timeout_s = watchdog_s
                self._watch.working(BUILDING)
            devices = devices_per_replica(ctx.world_size, dp, devices)
        if devices is None:
            raise ConfigError("emulate=True needs devices= (how many pipeline devices to emulate)")
        if tdev.type == "cpu":  # the optimizer's stage-sized temporaries: reused, not faulted in every step
            try:
                keep_freed_memory()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        sched_opts = dict(schedule_options or {})
        if dp > 1:  # the replicas' gradient all-reduces as actions of the schedule (pipeoptim schedule --data-parallel)
            sched_opts.setdefault("data_parallel", True)
        n_stages = stages_for(schedule, devices, sched_opts.get("chunks", 2))
        self.schedule = make_schedule(schedule, devices, microbatches, **sched_opts)
        self.policy_name = check_policy(self.schedule, policy)
        self.plan = Plan(self.schedule)
        self.stream = None  # runtime.stream.Stream: the micro-batches in flight carry from one train_step to the next
        if stream:
            self.stream = Stream(lambda n: make_schedule(schedule, devices, n, **sched_opts), microbatches)
        self.delay_rules = self._delay_rules(delay_hparams)
        self.eval_plan = Plan(self.schedule, forward_only=True)
        if tied and not self.schedule.synchronous:
            raise ConfigError(f"tied parameters need a synchronous schedule (gpipe, 1f1b, interleaved, chimera, "
                              f"bitpipe): under {self.schedule.name!r} the stages holding the copies step at different "
                              "times, so their summed gradient never exists. Use a synchronous schedule, or "
                              "copies=[(first, second), ...] to start the copies equal and train them as separate "
                              "weights")
        self.balance = None
        if stages is not None:
            cut = ModelCut.from_stages(stages, n_stages, schedule, devices)
        else:
            self.balance = choose_balance(layers, balance, sample, n_stages, tdev, seed, init_fn, ctx, BUILDING)
            cut = ModelCut.from_layers(layers, self.balance)
        self.checkpoint_stages = parse_checkpoint_stages(checkpoint_stages, [len(n) for n in cut.names])
        self.measure_activations = bool(measure_activations)
        self.devices, self.dp = devices, dp
        self.dp_rank = 0 if emulate else ctx.rank // devices  # this rank's pipeline replica (data_parallel)
        local = range(devices) if emulate else [ctx.rank % devices]
        gparams = cut.global_params(need_all=bool(tied or copies))
        self.tied = check_ties(tied, self.schedule, gparams)
        starts = [(tie[0], n) for tie in self.tied for n in tie[1:]] + check_copies(copies, gparams)
        stage_of = {n: st for n, (st, _) in gparams.items()}
        ties = plan_ties(self.tied, self.schedule, stage_of)
        del gparams
        # this process's stage modules: built (materialised) once per stage, a second replica copied
        modules: dict[Chunk, StageModule] = {}
        built: dict[int, StageModule] = {}
        for d in local:
            for c in self.schedule.chunks[d]:
                if c.stage in built:
                    modules[c] = cut.second_copy(built[c.stage], tdev)
                else:
                    modules[c] = built[c.stage] = cut.build(c.stage, tdev, seed, init_fn)
        cut.forget()
        del built
        if self._watch is not None:
            self._watch.doing(BUILT, COLLECTIVE)
        copy_starts(starts, stage_of, modules, self.schedule, local, ctx, devices)
        if self._watch is not None:
            self._watch.working(BUILDING)
        ckpt = self.checkpoint_stages
        working = torch.bfloat16 if precision == "bf16" else None
        self.workers: list[DeviceWorker] = []
        for d in local:
            runtimes = {c: self._runtime(c, modules.pop(c), optimizer, lr_scheduler, working, policy_options or {},
                                         ckpt) for c in self.schedule.chunks[d]}
            self.workers.append(DeviceWorker(self.plan, d, runtimes, loss_fn, autocast_dtype=working,
                                             device_type=tdev.type))
            self.workers[-1].ties = ties
            if straggler is not None and straggler[0] == d:
                self.workers[-1].slowdown = float(straggler[1])
        if emulate:
            self._runner = Emulator(self.plan, self.workers)
        else:
            if self._watch is not None:  # creating its process groups waits for every rank
                self._watch.doing(BUILT, COLLECTIVE)
            self._runner = Executor(self.plan, self.workers[0], dp_rank=self.dp_rank, dp_size=dp,
                                    device=tdev, watch=ctx.watch, link=link)
        self.device = tdev
        self.last_stats: dict = {}
        self.step_count = 0
        ModelCut.mark_taken(st.module for w in self.workers for st in w.stages.values())

    def _delay_rules(self, value) -> DelayRules | None:
        try:
            rules = DelayRules.of(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        if rules is None or not rules.active:
            return None
        if self.schedule.synchronous:
            raise ConfigError(f"delay_hparams adapts each stage's lr and momentum to its delay, but schedule "
                              f"{self.schedule.name!r} is synchronous (every delay is 0); use an asynchronous "
                              "schedule ('async-1f1b', 'async-zb', '2bw') or leave delay_hparams out")
        self._delays = stage_delays(self.schedule)
        return rules

    def _runtime(self, chunk: Chunk, module: StageModule, optimizer, lr_scheduler, working, policy_options,
                 ckpt) -> StageRuntime:
        names = {local: module.global_name(local) for local, _ in module.named_parameters()}
        opt = as_optimizer(optimizer(module.parameters()))  # a list of optimizers is chained into one
        pol = make_policy(self.policy_name, module, opt, update_every=self.plan.update_every(chunk),
                          working_dtype=working, **policy_options)
        if hasattr(pol, "place"):    # PipeOptim's constant s rules (paper, reference) need the stage's place
            pol.place(chunk.stage, self.schedule.num_stages)
        sched = lr_scheduler(opt) if lr_scheduler is not None else None
        if self.delay_rules is not None:
            sched = DelayAwareHParams(opt, self.delay_rules, delay=self._delays[chunk.stage],
                                      max_delay=max(self._delays.values()), stages=self.schedule.num_stages,
                                      inner=sched)
        pol.recompute = chunk.stage in ckpt
        pol.measure_activations = self.measure_activations
        return StageRuntime(chunk, module, opt, pol, sched, names, ckpt.get(chunk.stage, False))

    # ---- running ----------------------------------------------------------------------------------------
    def _split(self, batch):
        return split_batch(batch, self.schedule.num_microbatches, self.device)

    def train_step(self, batch) -> float:
        """One iteration of the schedule on ``batch`` (split into micro-batches); returns the mean loss, the
        same on every rank (with ``dp``: over every replica's micro-batches, each replica passing its own
        batch). ``last_stats`` also has the global gradient norm, the bubble fraction and whether some rank asked
        the job to stop (``stop``: ``request_stop``)."""
        mi, mt = self._split(batch)
        plan = self.plan
        if self.stream is not None:
            plan, first = self.stream.next()
            if first:  # the segment's micro-batches are labelled first..first+N-1 (runtime.stream)
                mi, mt = [None] * first + mi, [None] * first + mt
        self.last_stats = self._runner.run(plan, mi, mt, train=True, clip_norm=self.clip_norm)
        if self.stream is not None:
            self.stream.advance(plan)
        self.step_count += 1
        loss, skipped = self.last_stats["loss"], self.last_stats.get("nonfinite", 0)
        if skipped or not math.isfinite(loss):
            self._nonfinite(loss, skipped)
        return loss

    def drain(self) -> None:
        """``stream=True``: finish the micro-batches in flight (their backwards and steps), so that the weights,
        the optimizer and the policy hold no half-finished micro-batch; the next ``train_step`` fills the pipeline
        again. ``eval_step``, ``state_dict``, ``save`` and ``load`` drain first; call it before reading the weights
        some other way (``named_parameters``). Without a stream (or with nothing in flight) it does nothing."""
        plan = self.stream.drain() if self.stream is not None else None
        if plan is None:
            return
        with torch.enable_grad():  # (eval_step, under no_grad, drains first; a recomputing backward needs a graph)
            stats = self._runner.run(plan, [], [], train=True, clip_norm=self.clip_norm)
        self.stream.advance(plan)
        if stats.get("nonfinite", 0):
            self._nonfinite(self.last_stats.get("loss", float("nan")), stats["nonfinite"])

    def request_stop(self) -> None:
        """Ask the whole job to stop: the next ``train_step`` (or ``eval_step``) carries the request in the
        iteration's one reduction of scalars, and from then on ``last_stats["stop"]`` is True on every rank, at
        the same step, whichever rank asked. Nothing stops by itself: the training loop reads the flag, saves
        and returns. Safe to call from a signal handler (it sets a flag)."""
        self._runner.stop_requested = True

    def _nonfinite(self, loss: float, skipped: int) -> None:
        """Every rank gets here at the same step: the loss and the count come from the same all-reduce."""
        self.nonfinite_steps += 1
        what = f"step {self.step_count}: the loss was {loss:.6g}" if not math.isfinite(loss) else \
            f"step {self.step_count}: a gradient held a NaN or inf (loss {loss:.6g})"
        done = (f"{skipped} optimizer update(s) with a non-finite gradient were skipped" if skipped else
                "every gradient was finite, so the updates were applied")
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"{what}; {done}, so the weights hold no NaN or inf. Save them and look at this "
                                 "step's data, lower the learning rate or clip gradients, or skip such updates "
                                 "and go on (on_nonfinite='skip'; pipeoptim train --on-nonfinite skip)")
        if self.nonfinite_steps == 1:
            warnings.warn(f"{what}; {done} and training goes on (on_nonfinite='skip'); "
                          "pipe.nonfinite_steps counts such steps", RuntimeWarning, stacklevel=3)

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        """Forward only through the same pipeline, on the real weights (no prediction, no stash); a stream
        drains first (``drain``)."""
        mi, mt = self._split(batch)
        self.drain()
        stats = self._runner.run(self.eval_plan, mi, mt, train=False)
        return stats["loss"]

    # ---- state --------------------------------------------------------------------------------------------
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Global name -> this process's copy (replica 0 chunks; replica 1 holds the same values)."""
        out = {}
        for w in self.workers:
            for c, st in w.stages.items():
                if c.replica == 0:
                    for n, p in st.module.named_parameters():
                        out[st.names[n]] = p
        return out

    def state_dict(self) -> dict:
        from .runtime.checkpoint import pipeline_state
        self.drain()
        return pipeline_state(self)

    def save(self, directory: str, extra: dict | None = None, keep: int | None = None) -> str:
        """Write a checkpoint as ``directory/step-<step_count>/`` (call on every rank); ``extra`` is kept in
        meta.pt; ``keep``: how many of the newest checkpoints under ``directory`` to keep (None: all).
        Returns the checkpoint's own directory."""
        from .runtime.checkpoint import save
        self.drain()
        return save(self, directory, extra, keep)

    def load(self, directory: str, weights_only: bool = False, missing_ok: bool = False) -> dict | None:
        """Load the newest intact checkpoint under ``directory`` (or the ``step-*`` directory given), saved
        with any stage balance; returns the ``extra`` it was saved with; ``self.loaded_from`` says which.
        ``weights_only``: parameters only (e.g. to continue with another optimizer). ``missing_ok``: where no
        checkpoint was ever committed, load nothing and return None (a script that torchrun --max-restarts
        starts again resumes with the same line that its first start passes over)."""
        from .runtime.checkpoint import load
        self.drain()  # (what is in flight belongs to the run being replaced; finished, then overwritten)
        if self._watch is None:
            return load(self, directory, weights_only, missing_ok)
        with self._watch.during(f"loading checkpoint {directory}"):  # a rank frozen here is named in time
            return load(self, directory, weights_only, missing_ok)
