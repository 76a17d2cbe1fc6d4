"""Run a schedule's action lists for all devices in one process: the executor's oracle and a fast path.

The emulator holds one ``DeviceWorker`` per pipeline device and advances each device through its own list,
in order, as far as its inputs allow (a compute waits for its input; a ``Sync`` waits for all its members,
then sums their gradients in device order; the first ``Step`` of a synchronous schedule waits for every
device, sums the gradients of tied parameters (``tied``), then computes the global gradient norm). Each device
runs exactly the operations it runs under the distributed executor, on the same values (an activation is
copied, as on the wire; an input gradient, which its sender never reads again, is handed over), so with the
same seed, thread count and schedule the numbers agree bit for bit (sums over more than two members may differ
in the last bit: gloo adds in its own order).
"""
from __future__ import annotations

import math
import time

import torch

from ..schedules.actions import Forward, Step, Sync
from .executor import describe_failure
from .plan import COMPUTE, SYNC, WEIGHT, Plan, PipelineError
from .worker import DeviceWorker

__all__ = ["Emulator"]



class Emulator:
    def __init__(self, plan: Plan, workers: list[DeviceWorker]):
        if len(workers) != plan.num_devices:
            raise ValueError(f"the emulator needs one worker per device ({plan.num_devices}), got {len(workers)}")
        self.plan, self.workers = plan, workers
        self.stop_requested = False  # ``Pipeline.request_stop``: reported as ``stats["stop"]``

    def run(self, plan: Plan, inputs, targets, *, train: bool = True, clip_norm: float | None = None) -> dict:
        D = plan.num_devices
        for w in self.workers:
            w.begin(inputs, targets, train=train, plan=plan)
        mailbox: dict = {}  # consumer action -> its input, sent from another device (a copy, as on the wire)
        pos = [0] * D
        acts = plan.actions
        program = plan.program
        t0 = time.perf_counter()
        grad_norm = float("nan")
        coef: float | None = None
        norm_done = False
        phase = None  # a synchronous schedule's (busy, wall) up to its first Step, as the executor reports them
        sync_seen = [dict() for _ in range(D)]  # per device: Sync -> occurrences reached

        while any(pos[d] < len(acts[d]) for d in range(D)):
            moved = False
            for d in range(D):
                w = self.workers[d]
                local = w.local
                row = program[d]
                while pos[d] < len(row):
                    kind, a, src, out_to = row[pos[d]]
                    try:
                        if kind is COMPUTE:
                            if src is None:
                                data = None
                            elif src == d:
                                if a not in local:
                                    break
                                data = local.pop(a)
                            else:
                                if a not in mailbox:
                                    break
                                data = mailbox.pop(a)
                            forward = isinstance(a, Forward)
                            out = w.forward(a, data) if forward else w.backward(a, data)
                            if out is not None and out_to is not None:
                                if out_to.local:
                                    local[out_to.to_op] = out
                                elif forward:  # an activation: the sender keeps it (its graph, its input)
                                    mailbox[out_to.to_op] = tuple(None if x is None else x.clone() for x in out)
                                else:  # input gradients: nobody on the sender reads them again
                                    mailbox[out_to.to_op] = out
                        elif kind is WEIGHT:
                            w.backward_weight(a)
                        elif kind is SYNC:
                            if not self._sync(a, d, pos, acts, sync_seen):
                                break
                            moved = True
                            continue  # _sync advanced every member
                        else:  # Step
                            if plan.schedule.synchronous and not norm_done:
                                if not all(pos[e] < len(acts[e]) and isinstance(acts[e][pos[e]], Step)
                                           for e in range(D)):
                                    break
                                self._sum_ties()
                                total = torch.zeros((), dtype=torch.float64)
                                for e in range(D):
                                    total += self.workers[e].sq_norm()
                                grad_norm = math.sqrt(float(total))
                                norm_done = True
                                phase = (sum(x.busy for x in self.workers), time.perf_counter() - t0)
                                if clip_norm is not None:
                                    coef = min(1.0, clip_norm / (grad_norm + 1e-6))
                            finite = math.isfinite(grad_norm) if plan.schedule.synchronous else None
                            if not plan.schedule.synchronous and clip_norm is not None:
                                local_norm = w.chunk_norm(a.chunk)
                                coef = min(1.0, clip_norm / (local_norm + 1e-6))
                                finite = math.isfinite(local_norm)
                            w.step(pos[d], a, coef, finite)
                    except PipelineError:
                        raise
                    except Exception as e:
                        raise PipelineError(describe_failure(0, d, plan, a, e) + " [emulator]") from e
                    pos[d] += 1
                    moved = True
            if not moved:
                stuck = "; ".join(f"device {d} at {plan.schedule.format(acts[d][pos[d]])}"
                                  for d in range(D) if pos[d] < len(acts[d]))
                raise PipelineError(f"the schedule cannot make progress (deadlock): {stuck}")
        for w in self.workers:
            w.end()
        if mailbox:
            raise PipelineError(f"messages never consumed: {list(mailbox)[:4]}")
        busy, wall = phase or (sum(w.busy for w in self.workers), time.perf_counter() - t0)
        losses = torch.stack([v for w in self.workers for v in w.losses.values()]).double().tolist()  # one copy
        return {"loss": sum(losses) / len(losses), "grad_norm": grad_norm,
                "busy": busy / D, "wall": wall, "bubble": 1.0 - busy / (D * max(wall, 1e-12)),
                "nonfinite": sum(len(w.nonfinite) for w in self.workers), "stop": self.stop_requested}

    def _sum_ties(self) -> None:
        """Tied parameters: every copy's gradient becomes the sum over the copies (devices in order)."""
        for tie in self.workers[0].ties:
            parts = [(e, self.workers[e].tie_partial(tie)) for e in tie.devices]
            total = parts[0][1].clone()
            for _, p in parts[1:]:
                total += p
            for e, _ in parts:
                self.workers[e].tie_set(tie, total)

    def _sync(self, a: Sync, d: int, pos, acts, seen) -> bool:
        """Run Sync ``a`` once every member device stands at the same occurrence of it."""
        k = seen[d].get(a, 0)
        members = sorted(set(a.devices) | {d})
        for e in members:
            if pos[e] >= len(acts[e]) or acts[e][pos[e]] != a or seen[e].get(a, 0) != k:
                return False
        bufs = [self.workers[e].sync_buffers(a.stages) for e in members]
        with torch.no_grad():
            for j in range(len(bufs[0])):
                total = bufs[0][j].clone()
                for b in bufs[1:]:
                    total += b[j]
                for b in bufs:
                    b[j].copy_(total)
        for e in members:
            seen[e][a] = k + 1
            for c in self.workers[e].stages:
                if c.stage in a.stages:
                    self.workers[e].stages[c].policy.binding.grads_changed()
            pos[e] += 1
        return True
