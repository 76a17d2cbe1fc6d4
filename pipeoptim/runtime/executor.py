"""The distributed executor: one process per pipeline device walks that device's action list in order.

- Compute actions: the input comes from a local hand-off (chunks of one micro-batch on this device, e.g.
  BitPipe's V-turn), from the data (stage 0), or from ``comm.P2P`` (waited on just before the compute);
  the output is posted at once to its consumer (``dataflow.output_transfer``). A split backward's ``I`` moves
  data like a backward; its ``W`` has no input and no output. In a stream's segment (``stream``) an output
  whose consumer runs in the next call is kept (``Carried``) and sent by that call's first action (``CARRY``).
- ``Sync``: all-reduce (sum) of the local chunks' gradients over the process group of the listed pipeline
  devices; with ``dp`` it also spans the data-parallel copies and divides by their number (a sum over mirror
  copies, a mean over replicas); listing no devices, it is that mean alone (``Pipeline(dp=...)`` builds its
  schedule ``with_data_parallel``). Losses are scaled so that the sum is the mean over the iteration's
  micro-batches.
- ``Step``: with data parallelism, gradients that no ``Sync`` averaged over the replicas (a schedule built
  without ``data_parallel``) are averaged here: a synchronous schedule averages every such local chunk at its
  first ``Step`` (all of them, so the tie sums and the norm below read averaged gradients on every replica),
  an asynchronous one each chunk at its own ``Step``. Synchronous schedules then sum the gradients of tied
  parameters over their copies (``tied``) and compute the global gradient norm over the whole pipeline (each
  stage counted once) for clipping and reporting, in the iteration's one reduction of scalars over every rank
  (with the losses and times; ``scalars``). Asynchronous schedules clip per stage: the last stage must step
  before stage 0 has the micro-batch's gradient, so the pipeline-wide norm of that micro-batch does not exist
  yet.
- A ``Step`` whose gradient holds a NaN or inf is skipped (``DeviceWorker.step``); synchronous schedules
  decide on the global norm, so every rank skips the same iteration. The count is part of the stats every
  rank receives (``nonfinite``; asynchronous schedules sum it over the ranks at the end of the iteration), so
  all ranks learn of it at the same step; the replicas skip the same updates (their gradients are averaged
  first), which count once. A synchronous schedule's busy and wall time (the bubble) are its forward and
  backward phase's, up to the first ``Step``, where its scalars are summed over the ranks.
- Any exception is re-raised as ``PipelineError`` naming rank, device, stage and action, and published to
  every rank (``faults``). Each action, each wait for a peer and each collective is announced to the rank's
  watchdog (``watchdog``), which ends a job that stops making progress, naming who holds it up.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..schedules.actions import Forward, Sync
from .comm import P2P
from .faults import is_connection_loss
from .plan import COMPUTE, STEP, SYNC, WEIGHT, Plan, PipelineError
from .scalars import RankSum
from .stream import CARRY, Carried
from .watchdog import COLLECTIVE
from .worker import DeviceWorker

__all__ = ["Executor", "Groups", "describe_failure"]


def describe_failure(rank: int, device: int, plan: Plan, action, exc: BaseException) -> str:
    where = f"rank {rank} (pipeline device {device}"
    if action is not None:
        stage = getattr(action, "stage", None)
        if stage is None and isinstance(action, Sync):
            stage = "+".join(str(s) for s in action.stages)
        where += f", stage {stage}, action {plan.schedule.format(action)}"
    return f"{where}) failed: {type(exc).__name__}: {exc}"


class Groups:
    """Process groups for one pipeline layout; every rank creates all of them in the same order."""

    def __init__(self, plan: Plan, pp_rank: int, dp_rank: int, dp_size: int, tied_sets=(),
                 device: torch.device = torch.device("cpu")):
        D = plan.num_devices
        world = D * dp_size
        if dist.get_world_size() != world:
            raise PipelineError(f"the process group has {dist.get_world_size()} ranks but the pipeline needs "
                                f"{D} devices x {dp_size} data-parallel copies = {world}")
        rank_of = lambda q, d: q * D + d  # noqa: E731
        self.dp = None
        if dp_size > 1:
            for d in range(D):
                g = dist.new_group([rank_of(q, d) for q in range(dp_size)])
                if d == pp_rank:
                    self.dp = g
        self.sync: dict[tuple, object] = {}
        for devs in plan.sync_device_sets:
            if not devs:  # a data-parallel-only Sync (``with_data_parallel``): this device's replicas, or nobody
                self.sync[(devs, True)] = self.dp
                continue
            for q in range(dp_size):
                g = dist.new_group([rank_of(q, d) for d in devs])
                if q == dp_rank and pp_rank in devs:
                    self.sync[(devs, False)] = g
            if dp_size > 1:
                g = dist.new_group([rank_of(q, d) for q in range(dp_size) for d in devs])
                if pp_rank in devs:
                    self.sync[(devs, True)] = g
            else:
                self.sync[(devs, True)] = self.sync.get((devs, False))
        self.tied: dict[tuple, object] = {}  # owners of a tied parameter (more than one device)
        for devs in sorted(set(tied_sets)):
            for q in range(dp_size):
                g = dist.new_group([rank_of(q, d) for d in devs])
                if q == dp_rank and pp_rank in devs:
                    self.tied[devs] = g
        self.scalars = RankSum(device)  # the iteration's scalars, over every rank


class Executor:
    def __init__(self, plan: Plan, worker: DeviceWorker, *, dp_rank: int = 0, dp_size: int = 1,
                 device: torch.device = torch.device("cpu"), groups: Groups | None = None, watch=None,
                 link=None):
        """``link``: a ``links.Link`` the point-to-point messages are delayed by (an emulated link for
        benchmarks, ``comm.P2P``); None: the transport's own speed."""
        self.plan, self.worker, self.me = plan, worker, worker.device
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.rank = dp_rank * plan.num_devices + self.me
        tied_sets = [t.devices for t in worker.ties if len(t.devices) > 1]
        self.groups = groups or Groups(plan, self.me, dp_rank, dp_size, tied_sets, device)
        self.watch = watch
        self._doing = watch.doing if watch is not None else (lambda what, peer=None: None)
        self.p2p = P2P(plan, self.me, lambda d: dp_rank * plan.num_devices + d, device, wait=self._wait, link=link)
        # set by ``Pipeline.request_stop`` (a signal handler): sent with the next iteration's scalars, so every
        # rank learns at the same iteration that some rank asked the job to stop (``stats["stop"]``)
        self.stop_requested = False
        # a stream's outputs whose consumers run in the next call (``stream.Carried``): sent at its start
        self.carried: dict = {}

    def _wait(self, work, what: str, peer: int) -> None:
        self._doing(f"waiting for {what}", peer)
        work.wait()

    def run(self, plan: Plan, inputs, targets, *, train: bool = True, clip_norm: float | None = None) -> dict:
        """Run one iteration of ``plan`` (the training plan or its forward-only twin); returns stats that are
        the same on every rank: mean loss, global gradient norm (synchronous schedules), busy and wall time.

        The iteration's scalars travel in one reduction over the ranks: a synchronous schedule's at its first
        ``Step`` (the squared norm, the losses and the forward-backward phase's busy and wall time; its skipped
        updates follow from the norm), an asynchronous one's at the end (losses, times, skipped updates)."""
        w = self.worker
        self.p2p.reset(plan)
        w.begin(inputs, targets, train=train, plan=plan)
        t0 = time.perf_counter()
        grad_norm = float("nan")
        totals = None  # summed over the ranks: [loss sum, losses, busy, wall, skipped updates, stop requests]
        norm_reduced = False
        largest = -1.0  # asynchronous: the largest finite per-stage gradient norm of this rank's updates (-1: none)
        action = None
        self._dp_done: set[int] = set()
        doing = self._doing
        synchronous = plan.schedule.synchronous
        try:
            for i, (kind, action, src, out_to) in enumerate(plan.program[self.me]):
                if kind is WEIGHT:
                    doing(action)
                    w.backward_weight(action)
                elif kind is COMPUTE:
                    doing(action)
                    if src is None:    # the data, or the loss
                        data = None
                    elif src == self.me:  # a hand-off between this device's chunks
                        data = w.local.pop(action)
                    else:
                        data = self.p2p.recv(src, action)
                    doing(action)
                    out = w.forward(action, data) if isinstance(action, Forward) else w.backward(action, data)
                    if out is not None and out_to is not None:
                        if out_to.local:
                            w.local[out_to.to_op] = out
                        elif type(out_to) is Carried:  # its consumer runs in the next call (a stream)
                            self.carried[out_to.to_op] = out
                        else:
                            self.p2p.send(out_to.dst, out_to.to_op, out)
                elif kind is CARRY:
                    doing(action)
                    self.p2p.send(out_to.dst, out_to.to_op, self.carried.pop(out_to.to_op))
                elif kind is SYNC:
                    doing(action, COLLECTIVE)
                    group = self.groups.sync[(tuple(sorted(action.devices)), action.dp)]
                    bufs = w.sync_buffers(action.stages)
                    if group is not None:  # None: a data-parallel-only Sync of a single replica
                        for b in bufs:
                            dist.all_reduce(b, group=group)
                    if action.dp:
                        self._dp_done.update(action.stages)
                        for b in bufs:
                            b.div_(self.dp_size)
                    for c in w.stages:
                        if c.stage in action.stages:
                            w.stages[c].policy.binding.grads_changed()
                elif kind is STEP:
                    doing(action, COLLECTIVE if synchronous or self.dp_size > 1 else None)
                    coef, finite = None, None  # None: the worker checks this chunk's own gradient
                    if self.dp_size > 1 and synchronous and totals is None:
                        for c in w.stages:  # every chunk, before the ties and the norm read them
                            if c.stage not in self._dp_done:
                                self._dp_average(c)
                    elif self.dp_size > 1 and not synchronous and action.stage not in self._dp_done:
                        self._dp_average(action.chunk)
                    if synchronous:
                        if totals is None:
                            self._sum_ties()
                            sq, totals = self._reduce_scalars(plan, t0, with_norm=True)
                            grad_norm, norm_reduced = math.sqrt(sq), True
                        if clip_norm is not None:
                            coef = min(1.0, clip_norm / (grad_norm + 1e-6))
                        finite = math.isfinite(grad_norm)
                    elif clip_norm is not None:
                        local = w.chunk_norm(action.chunk)
                        coef = min(1.0, clip_norm / (local + 1e-6))
                        finite = math.isfinite(local)
                        if finite and local > largest:
                            largest = local
                    w.step(i, action, coef, finite)
            action = None
            self.p2p.finish()
            w.end()
            if totals is None:  # asynchronous, or a forward-only plan
                doing("the end-of-iteration sum of the loss over the ranks", COLLECTIVE)
                _, totals = self._reduce_scalars(plan, t0, with_norm=False, largest=largest)
                if (biggest := max(totals[6:])) >= 0:
                    grad_norm = biggest
        except PipelineError:
            raise
        except Exception as e:
            message = describe_failure(self.rank, self.me, plan, action, e)
            if self.watch is not None and not self.watch.signal(message, symptom=is_connection_loss(e)):
                cause = self.watch.cause  # another process said first why the job ends: that is what to read
                if cause and cause != message:  # (under torchrun no launcher prints it for this rank)
                    message = f"{cause}\n(so rank {self.rank} then failed: {message})"
            raise PipelineError(message) from e
        finally:
            if self.watch is not None:
                self.watch.idle()
        if self.watch is not None:
            self.watch.measured(time.perf_counter() - t0)
        loss_sum, count, busy, wall, skipped, stops = totals[:6]
        if norm_reduced and not math.isfinite(grad_norm):
            skipped = plan.num_steps  # every Step of the pipeline was skipped, on every rank
        D = plan.num_devices * self.dp_size
        return {"loss": loss_sum / count if count else float("nan"), "grad_norm": grad_norm, "busy": busy / D, "wall": wall / D,
                "bubble": 1.0 - busy / max(wall, 1e-12),
                "nonfinite": round(skipped / (1 if synchronous else self.dp_size)),  # replicas skip the same
                "stop": stops > 0}

    def _reduce_scalars(self, plan: Plan, t0: float, *, with_norm: bool,
                        largest: float | None = None) -> tuple[float, list[float]]:
        """Sum, in one reduction over every rank of every data-parallel copy (``scalars.RankSum``: the same total
        on every rank), this rank's share of the squared global gradient norm (``with_norm``; replica 0's ranks
        only: the replicas' averaged gradients are the same), its losses' sum and count, its busy and wall time
        so far, its skipped updates and whether it was asked to stop; and, given ``largest`` (an asynchronous
        iteration's largest per-stage norm here), one entry per rank holding each rank's (its own entry is its
        value, the others' 0: the sum is every rank's). Returns (squared norm, the other sums)."""
        w = self.worker
        sq = float(w.sq_norm()) if with_norm and self.dp_rank == 0 else 0.0
        loss_sum = sum(torch.stack(list(w.losses.values())).double().tolist()) if w.losses else 0.0  # one copy
        per_rank = []
        if largest is not None:
            per_rank = [0.0] * self.groups.scalars.world
            per_rank[self.groups.scalars.rank] = largest
        values = self.groups.scalars([sq, loss_sum, len(w.losses), w.busy, time.perf_counter() - t0,
                                      len(w.nonfinite), float(self.stop_requested), *per_rank])  # (every rank)
        return values[0], values[1:]

    def _sum_ties(self) -> None:
        """Tied parameters: each copy's gradient becomes the sum over all copies (all-reduce between the owning
        devices; a local sum when one device holds them all). Every rank walks the ties in the same order."""
        for tie in self.worker.ties:
            if self.me not in tie.devices:
                continue
            total = self.worker.tie_partial(tie)
            if len(tie.devices) > 1:
                dist.all_reduce(total, group=self.groups.tied[tie.devices])
            self.worker.tie_set(tie, total)

    def _dp_average(self, chunk) -> None:
        """Average ``chunk``'s gradient over the data-parallel replicas (the same device of every replica)."""
        for g in self.worker.stages[chunk].policy.binding.groups:
            dist.all_reduce(g.grad, group=self.groups.dp)
            g.grad.div_(self.dp_size)
        self.worker.stages[chunk].policy.binding.grads_changed()
