"""Jobs the fault-injection tests run on real processes: module-level so that spawned ranks can import them.

Run as a script to start one in its own session (see fault_harness):

    python tests/fault_jobs.py launch NPROCS MARKERS [--watchdog S] [--hang-rank R]    # runtime.launch
    python tests/fault_jobs.py startup MARKERS WHERE --watchdog S     # rank 1 of 2 stops itself at WHERE
    python -m torch.distributed.run --nproc-per-node N tests/fault_jobs.py torchrun MARKERS [--watchdog S]

Each rank writes ``MARKERS/running.<rank>`` after its first training step, so a test injects its fault into
a job that is really training.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn


def mse(y, t):
    return (y - t).pow(2).mean()


class Hang(nn.Module):
    """A linear layer whose forward never returns from step ``at`` on, on rank ``rank`` (a stage that stops
    making progress while its process stays alive: it never posts its send)."""

    def __init__(self, rank: int | None, at: int):
        super().__init__()
        self.lin, self.rank, self.at, self.calls = nn.Linear(8, 8), rank, at, 0

    def forward(self, x):
        self.calls += 1
        if self.rank is not None and int(os.environ.get("RANK", "-1")) == self.rank and self.calls >= self.at:
            time.sleep(3600)
        return self.lin(x)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def small_pipeline(stages: int, hang_rank: int | None = None, **kw):
    """A pipeline of ``stages`` linear layers, the same on every rank and in the emulator (seeded)."""
    from pipeoptim.train import Pipeline
    torch.manual_seed(0)
    layers = [Hang(hang_rank, 9) for _ in range(stages)]
    return Pipeline(layers, loss_fn=mse, schedule=kw.pop("schedule", "1f1b"), microbatches=kw.pop("microbatches", 4),
                    optimizer=kw.pop("optimizer", lambda ps: torch.optim.SGD(ps, lr=0.01)), **kw)


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def train_job(markers: str, steps: int = 100000, hang_rank: int | None = None,
              watchdog_s: float | None = None) -> str:
    """Train a small pipeline (one rank per stage) for ``steps`` steps; mark the first one."""
    from pipeoptim.runtime.dist_env import init_from_env
    ctx = init_from_env()
    pipe = small_pipeline(ctx.world_size, hang_rank, watchdog_s=watchdog_s)
    for step in range(steps):
        pipe.train_step(batch(step))
        if step == 0:
            open(os.path.join(markers, f"running.{ctx.rank}"), "w").close()
        time.sleep(0.01)
    return "finished"


# ---- a rank frozen during start-up ---------------------------------------------------------------------------
STARTUP_PHASES = ("rendezvous", "build", "load")


def startup_job(markers: str, stop_rank: int, where: str) -> str:
    """Start a pipeline with a copied weight (its build has a collective), save and load a checkpoint, then
    train; rank ``stop_rank`` SIGSTOPs itself at ``where``: before it joins the process group, while it builds
    its stage (materialising a meta layer), or as ``load`` begins. ``MARKERS/arrived.<rank>`` says a rank got
    to the rendezvous, ``MARKERS/stopping.<rank>`` that it stops now."""
    me = int(os.environ["RANK"])

    def reach(point: str) -> None:
        if me == stop_rank and where == point:
            if point == "build":  # let the heartbeat (every 1 s) publish "building" first: the test reads it
                time.sleep(2.5)
            open(os.path.join(markers, f"stopping.{me}"), "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)

    reach("rendezvous")
    open(os.path.join(markers, f"arrived.{me}"), "w").close()
    from pipeoptim.runtime.dist_env import init_from_env
    from pipeoptim.train import Pipeline
    init_from_env()
    with torch.device("meta"):
        layers = [nn.Linear(8, 8) for _ in range(2)]

    def init(layer):
        reach("build")
        layer.reset_parameters()

    pipe = Pipeline(layers, loss_fn=mse, schedule="1f1b", microbatches=2, init_fn=init,
                    copies=[("0.weight", "1.weight")], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    root = os.path.join(markers, "ckpt")
    pipe.save(root)
    reach("load")
    pipe.load(root)
    for step in range(3):
        pipe.train_step(batch(step))
    return "finished"


# ---- a rank killed while it writes its checkpoint part -----------------------------------------------------
def crash_in_checkpoint_job(root: str, crash_rank: int, where: str) -> None:
    """Two steps and a checkpoint (step 2), a third step, then a checkpoint during which ``crash_rank`` is
    SIGKILLed: ``where="part"`` halfway through writing its part, ``"manifest"`` (rank 0) after every part
    is in place but before the manifest."""
    from pipeoptim.runtime import checkpoint_files
    pipe = small_pipeline(2, microbatches=2)
    for step in range(2):
        pipe.train_step(batch(step))
    pipe.save(root)
    pipe.train_step(batch(2))
    me = int(os.environ["RANK"])
    if me == crash_rank and where == "part":
        real = checkpoint_files.write_file

        def write_half_then_die(path, write):
            if not os.path.basename(path).startswith("part-"):
                return real(path, write)
            import io
            buf = io.BytesIO()
            write(buf)
            with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint_files.write_file = write_half_then_die
    if me == crash_rank and where == "manifest":
        checkpoint_files.commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    pipe.save(root)


# ---- NaN in the data of one step ---------------------------------------------------------------------------
def wait_for_sigterm(marker: str, timeout_s: float = 60.0) -> str:
    """Rank side of a ``launch(..., forward_sigterm=True)`` job: say it runs (``marker.<rank>``), then wait for
    the SIGTERM the launcher passes on; returns what it saw."""
    import time

    from pipeoptim.runtime.launcher import sigterm_received
    open(f"{marker}.{os.environ['RANK']}", "w").close()
    t0 = time.monotonic()
    while not sigterm_received():
        if time.monotonic() - t0 > timeout_s:
            return "no SIGTERM"
        time.sleep(0.01)
    return "SIGTERM recorded"


def nan_batch(step: int, poisoned: int):
    x, y = batch(step)
    if step == poisoned:
        y[1, 3] = float("nan")  # one target of one micro-batch: that micro-batch's loss is NaN
    return x, y


def nan_run(pipe, poisoned: int, steps: int) -> dict:
    """Train ``pipe`` with a NaN in step ``poisoned``'s targets: where it stopped (step count and message, or
    None), its parameters, the non-finite steps it saw and each chunk's Adam step count."""
    from pipeoptim.train import NonFiniteError
    stopped = None
    for step in range(steps):
        try:
            pipe.train_step(nan_batch(step, poisoned))
        except NonFiniteError as e:
            stopped = (pipe.step_count, str(e))
            break
    updates = {}
    for w in pipe.workers:
        for c, st in w.stages.items():
            updates[c.stage] = max(int(s["step"]) for s in st.optimizer.state.values())
    return {"stopped": stopped, "params": {k: v.detach().clone() for k, v in pipe.named_parameters().items()},
            "nonfinite_steps": pipe.nonfinite_steps, "updates": updates}


def nan_job(poisoned: int, steps: int) -> list[dict]:
    """On every rank: a synchronous pipeline that stops at the poisoned step, then an asynchronous one that
    skips its non-finite updates and goes on."""
    stop = nan_run(small_pipeline(2, microbatches=2, optimizer=adam), poisoned, steps)
    skip = nan_run(small_pipeline(2, microbatches=4, optimizer=adam, schedule="async-1f1b", on_nonfinite="skip"),
                   poisoned, steps)
    return [stop, skip]


def _main(argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("launch", "torchrun", "startup"))
    p.add_argument("rest", nargs="*")
    p.add_argument("--watchdog", type=float, default=None)
    p.add_argument("--hang-rank", type=int, default=None)
    args = p.parse_args(argv)
    if args.mode == "torchrun":
        train_job(args.rest[0], watchdog_s=args.watchdog, hang_rank=args.hang_rank)
        return 0
    from pipeoptim.runtime import PipelineError, launch
    try:
        if args.mode == "startup":
            launch(startup_job, 2, args.rest[0], 1, args.rest[1], watchdog_s=args.watchdog)
            return 0
        nprocs, markers = int(args.rest[0]), args.rest[1]
        launch(train_job, nprocs, markers, 100000, args.hang_rank, args.watchdog)
    except PipelineError as e:
        print(f"job failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
