"""One device's share of a pipeline: its chunks, and what a compute or weight action does to them.

The distributed executor (one ``DeviceWorker`` per process) and the single-process emulator (all workers in
one process) run the very same code here; they differ only in how tensors travel between workers and how
collectives are computed. That is what lets the emulator be the executor's oracle.

The worker knows nothing of which weight policy runs: forwards run inside ``policy.forward(mb, s, lookahead)``, with
s from the schedule (``Plan.s_forward``) and the backward's look-ahead (``Plan.s_backward``), backwards inside
``policy.backward(mb, s=look-ahead)`` (both through ``call_forward`` / ``call_backward``, the same without a scope
object where the policy enters nothing), and ``Step`` actions call ``policy.step(next_s=...)``. Every chunk's graph
is cut at its boundary: inputs arrive detached and get ``requires_grad``, so a backward runs one chunk and yields
the gradients of that chunk's inputs. A split backward runs its input-gradient pass (``I``) and later its
weight-gradient pass (``W``, ``split_backward``) inside the policy's ``backward(..., part="input")`` and
``backward(..., part="weight")``.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import _engine_run_backward

from ..schedules.actions import Backward, BackwardInput, BackwardWeight, Chunk, Forward, Step
from .plan import Plan
from .grad_norm import sum_of_squares
from .split_backward import input_pass, weight_pass

__all__ = ["StageRuntime", "DeviceWorker", "as_tuple", "run_backward", "sum_of_squares"]


_NO_AUTOCAST = contextlib.nullcontext()  # reusable: entering it does nothing


def run_backward(tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(tensors, grads)`` for what a stage's backward starts from, without its
    argument normalisation: the caller has matched every gradient's shape and dtype to its output
    (``DeviceWorker._output_grads``; a loss starts from ``DeviceWorker._loss_seed``). That normalisation
    (``_make_grads``) costs as much per call as a small stage's backward itself (~40 µs of the tiny model's ~140
    on a slow Xeon), and a pipeline runs one backward per micro-batch and stage."""
    _engine_run_backward(tuple(tensors), tuple(grads), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


def _nothing() -> None:
    """A backward with no output to start from (no output of the stage needs a gradient)."""


def as_tuple(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(f"a stage must take and return a tensor or a tuple of tensors, got {type(x).__name__}")


@dataclass
class StageRuntime:
    """A chunk's module with its optimizer, LR scheduler and weight policy; ``names`` maps each parameter
    to its global name (independent of the stage balance; used by checkpoints)."""
    chunk: Chunk
    module: nn.Module
    optimizer: torch.optim.Optimizer
    policy: object
    scheduler: object | None = None
    names: dict[str, str] = field(default_factory=dict)  # local name -> global name
    checkpoint: bool | str | tuple = False  # activation recomputation: False, True/"all" (whole chunk), layer indices


class DeviceWorker:
    def __init__(self, plan: Plan, device: int, stages: dict[Chunk, StageRuntime],
                 loss_fn: Callable, *, autocast_dtype: torch.dtype | None = None, device_type: str = "cpu"):
        self.plan, self.device, self.stages, self.loss_fn = plan, device, stages, loss_fn
        self.autocast_dtype, self.device_type = autocast_dtype, device_type
        self.train = True
        self.busy = 0.0
        # an emulated straggler (benchmarks, ``Pipeline(straggler=...)``): each forward, backward and step of this
        # device is followed by a sleep of (slowdown - 1) x its own time, counted as busy
        self.slowdown = 1.0
        self.ties: list = []  # tied.TieGroup, the same list on every rank (set by the Pipeline)
        self._abouts: dict = {}  # compute action -> what _about derives for it from the plan being run
        self._abouts_by_plan: dict = {}  # id(plan) -> (plan, its _abouts): a stream's segments relabel actions
        self._seeds: dict = {}   # (shape, dtype, device, loss scale) -> _loss_seed's tensor

    # ---- iteration -------------------------------------------------------------------------------------
    def begin(self, inputs: list[tuple], targets: list, *, train: bool = True, plan: Plan | None = None) -> None:
        self.run_plan = plan = plan or self.plan
        self.inputs, self.targets, self.train = inputs, targets, train
        if not getattr(plan, "carries_in", False):  # (a stream's segment: the last call's forwards are in flight)
            self.saved: dict = {}
        known = self._abouts_by_plan.get(id(plan))
        if known is None or known[0] is not plan:
            known = self._abouts_by_plan[id(plan)] = (plan, {})
        self._abouts = known[1]
        self.weight_work: dict = {}   # (mb, chunk) -> what a split backward's W still has to compute
        self.losses: dict[int, torch.Tensor] = {}
        self.local: dict = {}
        self.busy = 0.0
        self.nonfinite: list[Step] = []  # steps skipped this iteration: their gradient held a NaN or inf
        for st in self.stages.values():
            if st.module.training != train:  # (a walk over every submodule: not once per step when unchanged)
                st.module.train(train)

    def end(self) -> None:
        in_flight = getattr(self.run_plan, "in_flight_after", None)
        if in_flight is not None and set(self.saved) != in_flight[self.device]:
            raise RuntimeError(f"device {self.device} ended a stream segment with forwards {sorted(self.saved)} "
                               f"in flight where the stream keeps {sorted(in_flight[self.device])}")
        if self.saved and in_flight is None:
            left = ", ".join(str(k) for k in list(self.saved)[:4])
            raise RuntimeError(f"device {self.device} ended the iteration with forwards that never ran backward: "
                               f"{left}; the schedule misses their Backward actions")
        if self.weight_work:
            left = ", ".join(str(k) for k in list(self.weight_work)[:4])
            raise RuntimeError(f"device {self.device} ended the iteration with split backwards whose weight "
                               f"gradient never ran: {left}; the schedule misses their W actions")
        for st in self.stages.values():
            if not st.module.training:
                st.module.train(True)

    def _autocast(self):
        if self.autocast_dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    # ---- compute ---------------------------------------------------------------------------------------
    def _about(self, op) -> tuple:
        """What the worker needs to know of compute action ``op``, derived from the plan once per action (a
        GPU step affords little Python work per action): (stage runtime, last stage?, the forward's s, the
        backward's look-ahead, the key of its saved tensors)."""
        about = self._abouts.get(op)
        if about is None:
            chunk = op.chunk
            key = (op.mb, chunk)
            plan = self.run_plan
            s = plan.s_forward(op) if isinstance(op, Forward) else 0
            about = self._abouts[op] = (self.stages[chunk], plan.is_last(chunk), s, plan.s_backward.get(key, 0), key)
        return about

    def forward(self, op: Forward, received: tuple | None) -> tuple | None:
        """Run ``op``; returns the tensors to deliver to its consumer (None on the last stage)."""
        t0 = time.perf_counter()
        st, last, s, lookahead, key = self._about(op)
        train = self.train
        if op.stage == 0:
            xs = self.inputs[op.mb]
        elif received is None:
            raise RuntimeError(f"no input arrived for {op}")
        elif train:
            xs = received
            for x in xs:
                if x.is_floating_point():
                    x.requires_grad_(True)
        else:
            xs = received
        if train:
            out, loss = st.policy.call_forward(op.mb, s, lookahead, self._forward_body, st, xs, op.mb, last)
            if last:
                self.losses[op.mb] = loss.detach().float()
                self.saved[key] = (xs, (loss,))  # its backward starts from the loss scale (_loss_seed)
            else:
                outs = as_tuple(out)
                self.saved[key] = (xs, outs)
        else:
            with torch.no_grad(), self._autocast():
                out = st.module(*xs)
                if last:
                    self.losses[op.mb] = self.loss_fn(out, self.targets[op.mb]).detach().float()
                else:
                    outs = as_tuple(out)
        self._straggle(t0)
        self.busy += time.perf_counter() - t0
        if last:
            return None
        return (outs[0].detach(),) if len(outs) == 1 else tuple(o.detach() for o in outs)

    def _forward_body(self, st: StageRuntime, xs: tuple, mb, last: bool) -> tuple:
        """What runs inside the policy's forward: the stage, and on the last stage its loss; (output, loss)."""
        if self.autocast_dtype is None:
            out = self._run_module(st, xs, mb) if st.checkpoint else st.module(*xs)
            return out, (self.loss_fn(out, self.targets[mb]) if last else None)
        with self._autocast():
            out = self._run_module(st, xs, mb)
            return out, (self.loss_fn(out, self.targets[mb]) if last else None)

    def _run_module(self, st: StageRuntime, xs: tuple, mb):
        if st.checkpoint:   # recomputed in the backward, on the weights the policy names (pipeoptim.stages.recompute)
            from ..stages.recompute import ALL, run_stage
            return run_stage(st.module, xs, ALL if st.checkpoint is True else st.checkpoint,
                             lambda: st.policy.recompute_context(mb))
        return st.module(*xs)

    def backward(self, op: Backward | BackwardInput, grads: tuple | None) -> tuple | None:
        """Run ``op`` (a full backward, or the input-gradient half ``I`` of a split one); returns its input
        gradients to deliver (None on stage 0)."""
        t0 = time.perf_counter()
        st, last, _, lookahead, key = self._about(op)
        xs, outs = self.saved.pop(key)
        tensors, grad_tensors = self._output_grads(op, last, outs, grads)
        if isinstance(op, BackwardInput):
            params = [p for p in st.module.parameters() if p.requires_grad]
            with st.policy.backward(op.mb, s=lookahead, part="input"):
                dxs, work = input_pass(tensors, grad_tensors, xs, params)
            self.weight_work[key] = (work, lookahead)
            self._straggle(t0)
            self.busy += time.perf_counter() - t0
            return None if op.stage == 0 else dxs
        if tensors:
            st.policy.call_backward(op.mb, lookahead, run_backward, tensors, grad_tensors)
        else:
            st.policy.call_backward(op.mb, lookahead, _nothing)
        self._straggle(t0)
        self.busy += time.perf_counter() - t0
        if op.stage == 0:
            return None
        return tuple([x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs])

    def _straggle(self, t0: float) -> None:
        if self.slowdown != 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0))

    def backward_weight(self, op: BackwardWeight) -> None:
        """Run ``op``: the weight gradients its ``I`` deferred, accumulated into the chunk's gradient buffer."""
        t0 = time.perf_counter()
        st = self.stages[op.chunk]
        key = (op.mb, op.chunk)
        if key not in self.weight_work:
            raise RuntimeError(f"{op} runs before its input-gradient pass I{op.mb}s{op.stage}")
        work, lookahead = self.weight_work.pop(key)
        with st.policy.backward(op.mb, s=lookahead, part="weight"):
            weight_pass(work)
        self._straggle(t0)
        self.busy += time.perf_counter() - t0

    def _output_grads(self, op, last: bool, outs: tuple, grads: tuple | None) -> tuple[list, list]:
        """The tensors a backward starts from and their gradients (on the last stage: the loss, from the loss scale)."""
        if last:
            tensors, grad_tensors = list(outs), [self._loss_seed(o) for o in outs]
        else:
            if grads is None or len(grads) != len(outs):
                n = "none" if grads is None else len(grads)
                raise RuntimeError(f"{op}: the stage returned {len(outs)} tensor(s) but {n} gradient(s) came back")
            tensors, grad_tensors = [], []
            for i, (o, g) in enumerate(zip(outs, grads)):
                if g is None or not o.requires_grad:
                    continue
                if g.shape != o.shape:
                    raise RuntimeError(f"{op}: gradient {i} has shape {tuple(g.shape)} but the stage's output {i} "
                                       f"has shape {tuple(o.shape)}; the next stage changed the shape of its "
                                       "input in place or returned a gradient for a different tensor")
                tensors.append(o)
                grad_tensors.append(g if g.dtype == o.dtype else g.to(o.dtype))  # (.to costs µs even as a no-op)
        return tensors, grad_tensors

    def _loss_seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a last stage's backward starts from: ``plan.loss_scale`` in the loss's shape, dtype and
        device (what ``loss * scale`` would send back, bit for bit, without that op in the forward and its
        backward node). One tensor per kind of loss, reused: autograd only reads it."""
        if loss.numel() != 1:
            raise RuntimeError(f"the loss has shape {tuple(loss.shape)}, but a loss must be a single number: "
                               "reduce it in loss_fn (e.g. return the mean over the micro-batch)")
        scale = self.plan.loss_scale
        key = (loss.shape, loss.dtype, loss.device, scale)
        seed = self._seeds.get(key)
        if seed is None:
            seed = self._seeds[key] = torch.full(loss.shape, scale, dtype=loss.dtype, device=loss.device)
        return seed

    # ---- weights ---------------------------------------------------------------------------------------
    def master_grads(self, chunks) -> list[torch.Tensor]:
        out = []
        for c in chunks:
            b = self.stages[c].policy.binding
            b.sync_grads()
            out += [g.master_grad for g in b.groups]
        return out

    def sync_buffers(self, stages) -> list[torch.Tensor]:
        """Gradient buffers of this device's chunks of ``stages``, in stage order (matches the mirror's)."""
        chunks = sorted((c for c in self.stages if c.stage in stages), key=lambda c: (c.stage, c.replica))
        return [g.grad for c in chunks for g in self.stages[c].policy.binding.groups]

    def _slot(self, chunk: Chunk, global_name: str) -> tuple:
        """(flat group, index) of the parameter called ``global_name`` in ``chunk``."""
        st = self.stages[chunk]
        local = next(n for n, g in st.names.items() if g == global_name)
        p = dict(st.module.named_parameters())[local]
        for g in st.policy.binding.groups:
            for j, q in enumerate(g.params):
                if q is p:
                    return g, j
        raise RuntimeError(f"tied parameter {global_name} of stage {chunk.stage} is not in its optimizer; build "
                           "the optimizer from all the stage's parameters")

    def _tie_members(self, tie) -> list[tuple[Chunk, str]]:
        return [(Chunk(tie.replica, stage), name) for d, stage, name in tie.members if d == self.device]

    def tie_partial(self, tie) -> torch.Tensor | None:
        """Sum of this device's copies' gradients of ``tie`` (None if it holds none), in member order."""
        total = None
        for chunk, name in self._tie_members(tie):
            g, j = self._slot(chunk, name)
            v = g.grad_views[j]
            total = v.detach().clone() if total is None else total.add_(v)
        return total

    def tie_set(self, tie, total: torch.Tensor) -> None:
        """Give every local copy of ``tie`` the summed gradient ``total``."""
        with torch.no_grad():
            for chunk, name in self._tie_members(tie):
                g, j = self._slot(chunk, name)
                g.grad_views[j].copy_(total)
                self.stages[chunk].policy.binding.grads_changed()

    def norm_chunks(self) -> list[Chunk]:
        """Chunks whose gradients count in the global norm: each stage once (replica 0 holds every stage)."""
        return [c for c in self.stages if c.replica == 0]

    def sq_norm(self) -> torch.Tensor:
        """This device's share of the squared global gradient norm (float64 scalar)."""
        total = sum_of_squares(self.master_grads(self.norm_chunks()))
        copies = []  # a tied weight counts once: drop its other copies (replica 0, after the sum)
        for tie in self.ties:
            if tie.replica != 0:
                continue
            for d, stage, name in tie.members[1:]:
                if d == self.device:
                    g, j = self._slot(Chunk(0, stage), name)
                    copies.append(g.master_grad_views[j])
        if not copies:
            return total
        # (the two float32 norms may round a share of only tied copies below 0)
        return (total - sum_of_squares(copies)).clamp_min(0.0)

    def chunk_norm(self, chunk: Chunk) -> float:
        """The gradient norm of one chunk (asynchronous schedules clip per stage)."""
        return math.sqrt(float(sum_of_squares(self.master_grads([chunk]))))

    def grads_finite(self, chunks) -> bool:
        """Whether every gradient of ``chunks`` is finite.

        A float32 sum is finite only when every element is (an inf or a NaN makes every partial sum that
        includes it inf or NaN), so a finite one settles it in one pass without a copy. When it is not, the
        float64 sum decides (it cannot overflow from float32 values): a large but finite gradient is never
        called non-finite. Summing in float64 from the start made a float64 copy of each buffer: 21 ms for a
        6.3M-parameter stage on a Xeon, about what its AdamW update takes (``benchmarks/probe_grads_finite.py``)."""
        for g in self.master_grads(chunks):
            if not math.isfinite(float(g.sum(dtype=torch.float32))) and \
                    not math.isfinite(float(g.sum(dtype=torch.float64))):
                return False
        return True

    def step(self, index: int, action: Step, clip_coef: float | None = None, finite: bool | None = None) -> None:
        """Take ``action``'s optimizer step, unless the gradient is not finite: then the update, its LR
        scheduler step and the policy's state are skipped and the gradient dropped (``self.nonfinite``).
        ``finite``: the caller's verdict (the global norm of a synchronous schedule); None: check this chunk."""
        t0 = time.perf_counter()
        st = self.stages[action.chunk]
        if finite is None:
            finite = self.grads_finite([action.chunk])
        if not finite:
            self.nonfinite.append(action)
        elif clip_coef is not None and clip_coef < 1.0:
            for g in self.master_grads([action.chunk]):
                g.mul_(clip_coef)
        stepped = st.policy.step(next_s=self.run_plan.next_s(self.device, index), skip=not finite)
        if stepped and st.scheduler is not None:
            st.scheduler.step()
        self._straggle(t0)
        self.busy += time.perf_counter() - t0
