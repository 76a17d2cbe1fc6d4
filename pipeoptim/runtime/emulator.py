"""Run a schedule's action lists for all devices in one process: the executor's oracle and a fast path.

The emulator holds one ``DeviceWorker`` per pipeline device and advances each device through its own list,
in order, as far as its inputs allow (a compute waits for its input; a ``Sync`` waits for all its members,
then sums their gradients in device order; the first ``Step`` of a synchronous schedule waits for every
device, sums the gradients of tied parameters (``tied``), then computes the global gradient norm). That order
depends on the data flow alone, so it is derived once per plan (``run_order``) and a step only follows it, with
no per-action test of what has arrived (that test cost ~4 % of a step of bench_runtime_peer.py's tiny model).
Each device runs exactly the operations it runs under the distributed executor, on the same values (an activation is
copied, as on the wire; an input gradient, which its sender never reads again, is handed over), so with the
same seed, thread count and schedule the numbers agree bit for bit (sums over more than two members may differ
in the last bit: gloo adds in its own order). A stream's output whose consumer runs in the next call
(``stream.Carried``) is kept until that call's ``CARRY`` entry hands it over.
"""
from __future__ import annotations

import math
import time

import torch

from ..errors import ConfigError
from ..schedules.actions import Forward, Step, Sync
from .executor import describe_failure
from .plan import COMPUTE, STEP, SYNC, WEIGHT, Plan, PipelineError
from .stream import CARRY, Carried
from .worker import DeviceWorker

__all__ = ["Emulator", "emulated_device", "run_order"]

NORM = "norm"  # a run_order entry: the global gradient norm, before a synchronous schedule's first Step


def _copy(tensors: tuple) -> tuple:
    """A forward's outputs as they arrive on another device: copies (a stage's outputs are tensors)."""
    return (tensors[0].clone(),) if len(tensors) == 1 else tuple(x.clone() for x in tensors)


def emulated_device(device) -> torch.device:
    """The one device an emulated pipeline runs every stage on; asking for a GPU that is not there is an error,
    never a silent CPU run."""
    try:
        tdev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a device; use 'cpu' or 'cuda'") from None
    if tdev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but no GPU is visible (torch.cuda.is_available() is False); use "
                              "device='cpu'")
        if tdev.index is None:
            tdev = torch.device("cuda", torch.cuda.current_device())
        if tdev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif tdev.type != "cpu":
        raise ConfigError(f"device={device!r}: an emulated pipeline runs on 'cpu' or 'cuda'")
    return tdev


class Emulator:
    def __init__(self, plan: Plan, workers: list[DeviceWorker]):
        if len(workers) != plan.num_devices:
            raise ValueError(f"the emulator needs one worker per device ({plan.num_devices}), got {len(workers)}")
        self.plan, self.workers = plan, workers
        self.stop_requested = False  # ``Pipeline.request_stop``: reported as ``stats["stop"]``
        self._orders: dict[int, tuple[Plan, list]] = {}  # id(plan) -> (plan, its run order as _order gives it)
        self.carried: dict = {}  # a stream's outputs whose consumers run in the next call (``stream.Carried``)

    def run(self, plan: Plan, inputs, targets, *, train: bool = True, clip_norm: float | None = None) -> dict:
        D = plan.num_devices
        order = self._order(plan)
        workers = self.workers
        for w in workers:
            w.begin(inputs, targets, train=train, plan=plan)
        inbox: dict = {}  # consumer action -> its input (from another device: a copy, as on the wire)
        synchronous = plan.schedule.synchronous
        t0 = time.perf_counter()
        grad_norm = float("nan")
        coef: float | None = None
        phase = None  # a synchronous schedule's (busy, wall) up to its first Step, as the executor reports them
        carried = self.carried
        for kind, d, a, src, out_key, index, run, copy in order:
            try:
                if kind is COMPUTE:
                    if src is None:
                        data = None
                    else:
                        data = inbox.pop(a, None)
                        if data is None:
                            raise RuntimeError("its input never arrived: the action that feeds it returned nothing")
                    out = run(a, data)
                    if out is not None and out_key is not None:
                        if copy is None:  # its consumer runs in the next call (a stream): kept until then
                            carried[out_key] = out
                        else:
                            inbox[out_key] = _copy(out) if copy else out
                elif kind is CARRY:
                    inbox[out_key] = carried.pop(out_key)
                elif kind is WEIGHT:
                    workers[d].backward_weight(a)
                elif kind is SYNC:
                    self._sync(a, src)
                elif kind is NORM:
                    self._sum_ties()
                    total = torch.zeros((), dtype=torch.float64)
                    for e in range(D):
                        total += workers[e].sq_norm()
                    grad_norm = math.sqrt(float(total))
                    phase = (sum(x.busy for x in workers), time.perf_counter() - t0)
                    if clip_norm is not None:
                        coef = min(1.0, clip_norm / (grad_norm + 1e-6))
                else:  # Step
                    finite = math.isfinite(grad_norm) if synchronous else None
                    if not synchronous and clip_norm is not None:
                        local_norm = workers[d].chunk_norm(a.chunk)
                        coef = min(1.0, clip_norm / (local_norm + 1e-6))
                        finite = math.isfinite(local_norm)
                        if finite and not local_norm <= grad_norm:  # the largest per-stage norm (NaN: none yet)
                            grad_norm = local_norm
                    workers[d].step(index, a, coef, finite)
            except PipelineError:
                raise
            except Exception as e:
                raise PipelineError(describe_failure(0, d, plan, a, e) + " [emulator]") from e
        for w in workers:
            w.end()
        if inbox:
            raise PipelineError(f"messages never consumed: {list(inbox)[:4]}")
        busy, wall = phase or (sum(w.busy for w in workers), time.perf_counter() - t0)
        losses = [v for w in workers for v in w.losses.values()]
        losses = torch.stack(losses).double().tolist() if losses else []  # one copy (a stream's drain has none)
        return {"loss": sum(losses) / len(losses) if losses else float("nan"), "grad_norm": grad_norm,
                "busy": busy / D, "wall": wall, "bubble": 1.0 - busy / (D * max(wall, 1e-12)),
                "nonfinite": sum(len(w.nonfinite) for w in workers), "stop": self.stop_requested}

    def _order(self, plan: Plan) -> list[tuple]:
        """``run_order(plan)``, each entry with what running it needs: ``(kind, device, action, input source,
        consumer action of its output, index, the worker's method, whether the output is copied)``."""
        known = self._orders.get(id(plan))
        if known is None or known[0] is not plan:
            steps = []
            # the consumer's own action object as the inbox key: a lookup by an equal but distinct object also
            # compares the two (a dataclass __eq__), one per message
            own = {a: a for row in plan.actions for a in row}
            for kind, d, a, src, out_to, index in run_order(plan):
                w = self.workers[d]
                forward = isinstance(a, Forward)
                run = (w.forward if forward else w.backward) if kind is COMPUTE else None
                # an activation crossing devices is copied, as on the wire; the sender keeps its own (its graph).
                # Input gradients are handed over: nobody on the sender reads them again. None: kept for the
                # next call (``stream.Carried``: a backward's output, handed over then)
                copy = None if type(out_to) is Carried else forward and out_to is not None and not out_to.local
                key = None if out_to is None else own.get(out_to.to_op, out_to.to_op)
                steps.append((kind, d, a, src, key, index, run, copy))
            known = self._orders[id(plan)] = (plan, steps)
        return known[1]

    def _sum_ties(self) -> None:
        """Tied parameters: every copy's gradient becomes the sum over the copies (devices in order)."""
        for tie in self.workers[0].ties:
            parts = [(e, self.workers[e].tie_partial(tie)) for e in tie.devices]
            total = parts[0][1].clone()
            for _, p in parts[1:]:
                total += p
            for e, _ in parts:
                self.workers[e].tie_set(tie, total)

    def _sync(self, a: Sync, members: list[int]) -> None:
        """Sum the gradients of ``a``'s stages over its member devices (in device order) into every member."""
        bufs = [self.workers[e].sync_buffers(a.stages) for e in members]
        with torch.no_grad():
            for j in range(len(bufs[0])):
                total = bufs[0][j].clone()
                for b in bufs[1:]:
                    total += b[j]
                for b in bufs:
                    b[j].copy_(total)
        for e in members:
            for c in self.workers[e].stages:
                if c.stage in a.stages:
                    self.workers[e].stages[c].policy.binding.grads_changed()


def run_order(plan: Plan) -> list[tuple]:
    """The order in which one process runs every device's actions: each device through its own list, as far
    as its inputs allow, the devices in turn (a compute waits for its input; a ``Sync`` for all its members,
    then runs once for all of them; the first ``Step`` of a synchronous schedule for every device, preceded by
    the global gradient norm). Derived once per plan from the data flow alone, so running a step asks nothing
    per action but what to run. Entries: ``(kind, device, action, input source, output transfer, index in the
    device's list)``; a ``Sync`` entry's source is its member devices, and the norm is an entry of kind
    ``NORM``."""
    D = plan.num_devices
    program = plan.program
    acts = plan.actions
    pos = [0] * D
    arrived: set = set()  # consumer actions whose input has been produced
    seen = [dict() for _ in range(D)]  # per device: Sync -> occurrences reached
    synchronous = plan.schedule.synchronous
    norm_done = False
    order: list[tuple] = []
    while any(pos[d] < len(acts[d]) for d in range(D)):
        moved = False
        for d in range(D):
            row = program[d]
            while pos[d] < len(row):
                kind, a, src, out_to = row[pos[d]]
                if kind is COMPUTE:
                    if src is not None:
                        if a not in arrived:
                            break
                        arrived.remove(a)
                    if out_to is not None and type(out_to) is not Carried:
                        arrived.add(out_to.to_op)
                elif kind is CARRY:  # a stream's output kept from the last call
                    arrived.add(out_to.to_op)
                elif kind is SYNC:
                    k = seen[d].get(a, 0)
                    members = sorted(set(a.devices) | {d})
                    if not all(pos[e] < len(acts[e]) and acts[e][pos[e]] == a and seen[e].get(a, 0) == k
                               for e in members):
                        break
                    order.append((SYNC, d, a, members, None, pos[d]))
                    for e in members:
                        seen[e][a] = k + 1
                        pos[e] += 1
                    moved = True
                    continue
                elif kind is STEP and synchronous and not norm_done:
                    if not all(pos[e] < len(acts[e]) and isinstance(acts[e][pos[e]], Step) for e in range(D)):
                        break
                    order.append((NORM, d, None, None, None, pos[d]))
                    norm_done = True
                order.append((kind, d, a, src, out_to, pos[d]))
                pos[d] += 1
                moved = True
        if not moved:
            stuck = "; ".join(f"device {d} at {plan.schedule.format(acts[d][pos[d]])}"
                              for d in range(D) if pos[d] < len(acts[d]))
            raise PipelineError(f"the schedule cannot make progress (deadlock): {stuck}")
    return order
