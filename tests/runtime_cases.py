"""Shared fixtures for the runtime tests: a small GPT, a fixed batch, the cases each schedule runs, and the
worker functions the spawned ranks execute (module-level, so spawned processes can import them)."""
from __future__ import annotations

import torch

from pipeoptim.models import GPTConfig, gpt_layers
from pipeoptim.models.gpt import lm_loss

CFG = GPTConfig(seq_len=8, d_model=16, n_heads=2, n_layers=6)  # 8 layers: enough for BitPipe on 4 devices
STEPS = 2

# (schedule, policy, devices, microbatches, dp, options)
SYNC_CASES = [("gpipe", None, 4, 4, 1, {}), ("1f1b", None, 4, 4, 1, {}), ("interleaved", None, 4, 4, 1, {}),
              ("chimera", None, 4, 4, 1, {}), ("bitpipe", None, 4, 4, 1, {}), ("1f1b", None, 2, 2, 2, {})]
ASYNC_CASES = [("async-1f1b", p, 4, 4, 1, {}) for p in ("none", "stash", "spectrain", "pipeoptim")] + \
              [("2bw", "2bw", 4, 8, 1, {}), ("async-1f1b", "pipeoptim", 2, 4, 2, {})]


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 256, (n, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def single_process_reference(layers, N: int, steps: int = STEPS):
    """Plain training of `layers` as one nn.Sequential, SGD, each step on N micro-batches of the same batch:
    ({"<layer>.<param>": weights after training}, [global gradient norm per step]) — the pipelines' oracle."""
    from torch import nn
    model = nn.Sequential(*layers)
    opt = sgd(model.parameters())
    norms = []
    for i in range(steps):
        x, y = batch(i)
        opt.zero_grad()
        for xm, ym in zip(x.chunk(N), y.chunk(N)):
            (lm_loss(model(xm), ym) / N).backward()
        norms.append(float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))))
        opt.step()
    params = {}
    for i, layer in enumerate(model):
        for n, p in layer.named_parameters(remove_duplicate=False):
            params[f"{i}.{n}"] = p.detach().clone()
    return params, norms


def make_pipeline(case, emulate: bool, optimizer=adamw, **kw):
    from pipeoptim.train import Pipeline
    sched, policy, D, N, dp, opts = case
    return Pipeline(gpt_layers(CFG, seed=1), loss_fn=lm_loss, optimizer=optimizer, devices=D, schedule=sched,
                    policy=policy, microbatches=N, emulate=emulate, dp=1 if emulate else dp, **opts, **kw)


def train(pipe, steps: int = STEPS):
    losses, norms = [], []
    for i in range(steps):
        losses.append(pipe.train_step(batch(i)))
        norms.append(pipe.last_stats["grad_norm"])
    params = {k: v.detach().float().clone() for k, v in pipe.named_parameters().items()}
    return {"losses": losses, "norms": norms, "params": params}


def run_cases(cases):
    """Rank side: train every case in turn (a data-parallel case uses the ranks as D x dp)."""
    return [train(make_pipeline(c, emulate=False)) for c in cases]


def train_stream(pipe, calls: int = 3):
    """``calls`` train_steps of a stream (``stream=True``), then its drain: losses and the weights after."""
    losses = [pipe.train_step(batch(i)) for i in range(calls)]
    pipe.drain()
    return {"losses": losses, "params": {k: v.detach().float().clone() for k, v in pipe.named_parameters().items()}}


def run_stream_cases(cases, calls: int = 3):
    """Rank side: ``train_stream`` every case in turn."""
    return [train_stream(make_pipeline(c, emulate=False, stream=True), calls) for c in cases]


def count_reductions(cases, steps: int = STEPS):
    """Rank side: per case and training iteration, the sizes of the tensors all-reduced (gradient buffers) and
    of the value lists summed by ``scalars.RankSum``, and every iteration's stats."""
    import torch.distributed as dist

    from pipeoptim.runtime.scalars import RankSum
    real_all_reduce, real_sum = dist.all_reduce, RankSum.__call__
    out = []
    for case in cases:
        pipe = make_pipeline(case, emulate=False)
        sizes, scalar_sums, stats = [], [], []

        def counting(tensor, *args, **kwargs):
            sizes[-1].append(tensor.numel())
            return real_all_reduce(tensor, *args, **kwargs)

        def counting_sum(self, values):
            scalar_sums[-1].append(len(values))
            return real_sum(self, values)
        dist.all_reduce, RankSum.__call__ = counting, counting_sum
        try:
            for i in range(steps):
                sizes.append([])
                scalar_sums.append([])
                pipe.train_step(batch(i))
                stats.append(dict(pipe.last_stats))
        finally:
            dist.all_reduce, RankSum.__call__ = real_all_reduce, real_sum
        out.append({"sizes": sizes, "scalar_sums": scalar_sums, "stats": stats})
    return out


def count_messages(cases, steps: int = STEPS):
    """Rank side: per case and training iteration (an evaluation after the first), how many receives this rank
    posted when the iteration started and after it, how many messages it received, and how many headers (the
    side tag) it sent: the runtime's receives on gloo are all posted ahead once shapes are known."""
    from pipeoptim.runtime import comm
    real_start = comm._start
    out = []
    for case in cases:
        pipe = make_pipeline(case, emulate=False)
        p2p = pipe._runner.p2p
        real_reset = p2p.reset
        phase = {"reset": False}
        counts: list[dict] = []

        def counting(op, tensors, peer, tag=0):
            c = counts[-1]
            if op is comm.dist.irecv:
                c["posted_at_start" if phase["reset"] else "posted_later"] += len(tensors)
            elif tag == comm.SIDE_TAG:
                c["headers_sent"] += len(tensors)
            return real_start(op, tensors, peer, tag)

        def reset(plan):
            phase["reset"] = True
            try:
                real_reset(plan)
            finally:
                phase["reset"] = False
        comm._start, p2p.reset = counting, reset
        try:
            for i in range(steps):
                counts.append({"posted_at_start": 0, "posted_later": 0, "headers_sent": 0})
                pipe.train_step(batch(i))
                counts[-1]["received"] = sum(len(seq) for (src, dst), seq in pipe.plan.channels.items()
                                             if dst == p2p.me)
                if i == 0:
                    pipe.eval_step(batch(100))
        finally:
            comm._start = real_start
        out.append(counts)
    return out


def one_device_job(device: str, schedule: str, policy, emulate: bool, steps: int = 3):
    """A one-device pipeline of 3 Linear-Tanh layers on ``device`` (run as a one-rank job: NCCL on a GPU, gloo on
    the CPU; or emulated): the losses, the last stats and the weights (on the CPU) after ``steps`` steps."""
    from torch import nn

    from pipeoptim.train import Pipeline

    def layer(i):
        torch.manual_seed(10 + i)
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh()).to(device)

    pipe = Pipeline([layer(i) for i in range(3)], loss_fn=lambda y, t: nn.functional.mse_loss(y, t), devices=1,
                    optimizer=adamw, schedule=schedule, policy=policy, microbatches=4, emulate=emulate, device=device)
    g = torch.Generator().manual_seed(5)
    losses = [pipe.train_step((torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)))
              for _ in range(steps)]
    return {"losses": losses, "stats": dict(pipe.last_stats),
            "params": {k: v.detach().cpu().clone() for k, v in pipe.named_parameters().items()}}


def stop_flags(case, askers: tuple[int, ...], steps: int = 3) -> list[list[bool]]:
    """For each rank in ``askers``, a fresh pipeline on which that rank calls ``request_stop`` after the first
    step; every rank returns, per asker, ``last_stats["stop"]`` after each step (what each rank learns, and
    when)."""
    import torch.distributed as dist
    per_asker = []
    for asker in askers:
        pipe = make_pipeline(case, emulate=False)
        seen = []
        for step in range(steps):
            pipe.train_step(batch(step))
            seen.append(pipe.last_stats["stop"])
            if step == 0 and dist.get_rank() == asker:
                pipe.request_stop()
        per_asker.append(seen)
    return per_asker
