"""Does the simulator predict real multi-process runs over an emulated link? (issue 43, the model's proof)

Why this script exists: the regime map (``bench_regime_map.py``) ranks schedules by the simulator's time per
update under a link. Here real 4-process jobs of this machine run each schedule (1F1B, GPipe, ZBV, BitPipe, 2BW,
asynchronous 1F1B) over the runtime's emulated link (``Pipeline(link=...)``: every point-to-point message held
until latency + bytes / bandwidth after it was sent, ``runtime.comm``), and the simulator is fed with the costs
measured in that same run: each forward, backward (ZBV: input and weight halves) and optimizer step, timed inside
the worker on every rank and taken as the per-stage median over the timed steps. Then the measured wall time of
a step (the slowest rank's) is set against the simulated makespan of the same schedule, row by row.

Profiles, all EMULATED (the messages cross loopback; the emulation only adds the delay):
- ``lan-emulated``: 10 ms, 1 Gbit/s per hop;
- ``internet-emulated``: 30 ms, 100 Mbit/s per hop (``pipeoptim.links.PROFILES["internet"]``);
- ``internet-emulated`` with an emulated straggler, pipeline device 1 computing 2x slower (``straggler=(1, 2.0)``);
- ``wan-emulated``: 100 ms, 100 Mbit/s per hop (an intercontinental hop), where the link dominates most.
The latencies are chosen large against the compute (a tiny GPT, one op ~1-5 ms here): 4 processes share 2
cores with other jobs, so compute times are distorted by the scheduler; the link dominates so that the check is
of the timeline model (who waits for which message), not of this machine's noise. BitPipe's mirror all-reduces
run over gloo at loopback speed (the emulation delays point-to-point messages only) and are priced free.

Diagnosis beside the target: each rank also records how late every message was handed out past its due time
(the process was not running when the message fell due: 4 processes on 2 shared cores), and the simulator is
run a second time with that mean lateness added to the link's latency (``simulated_late_s``). The target is
judged on ``simulated_s``, the nominal link.

    python benchmarks/bench_link_validation.py                 # all six schedules, the four settings, D = 4
    python benchmarks/bench_link_validation.py --devices 2     # the same with one process per core (2 cores)
    python benchmarks/bench_link_validation.py --schedules 1f1b --steps 2 --out /tmp/lv   # a quick look

Writes results/link_validation.csv: schedule, profile, devices, measured_s, simulated_s, plus straggler, link,
error (simulated / measured - 1), within_15pct, late_ms (mean lateness of a message past its due time),
simulated_late_s, microbatches, steps, machine.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

DEVICES = 4
MICROBATCHES = 8
ROWS = 2                       # sequences per micro-batch
GPT = dict(vocab_size=256, seq_len=32, d_model=32, n_heads=2, n_layers=8)
SCHEDULES = ("1f1b", "gpipe", "zbv", "bitpipe", "2bw", "async-1f1b")
# (profile, link spec, straggler): every one an emulation
SETTINGS = (("lan-emulated", "latency=10ms,bandwidth=1Gbit", None),
            ("internet-emulated", "internet", None),
            ("internet-emulated", "internet", (1, 2.0)),
            ("wan-emulated", "latency=100ms,bandwidth=100Mbit", None))
TOLERANCE = 0.15


def message_bytes() -> int:
    """A boundary message: the hidden states (rows x seq x d_model x 4 bytes) after 16 bytes of flag and stamp."""
    return 16 + ROWS * GPT["seq_len"] * GPT["d_model"] * 4


def _batch(step: int):
    import torch
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (MICROBATCHES * ROWS, GPT["seq_len"]), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _record(worker, ops: dict) -> None:
    """Time every forward, backward (I), weight pass (W) and step of ``worker`` into ``ops[(kind, stage)]``."""
    from pipeoptim.schedules.actions import BackwardInput

    def timed(fn, kind_of):
        def run(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            action = args[1] if fn.__name__ == "step" else args[0]
            ops.setdefault((kind_of(action), action.stage), []).append(time.perf_counter() - t0)
            return out
        return run
    worker.forward = timed(worker.forward, lambda a: "F")
    worker.backward = timed(worker.backward, lambda a: "I" if isinstance(a, BackwardInput) else "B")
    worker.backward_weight = timed(worker.backward_weight, lambda a: "W")
    worker.step = timed(worker.step, lambda a: "S")


def _record_lateness(p2p, late: list) -> None:
    """Record how long after its due time each message was handed out (``comm.P2P._deliver``)."""
    deliver = type(p2p)._deliver

    def timed(layout, buf):
        due = float(layout.stamp(buf))
        deliver(p2p, layout, buf)
        late.append(max(0.0, time.time() - due))
    p2p._deliver = timed


def rank_job(schedule: str, steps: int, warmup: int, devices: int = DEVICES) -> list[dict]:
    """One rank: for each setting, ``warmup`` + ``steps`` train steps over the emulated link; returns per setting
    the slowest rank's step times and this rank's per-op medians."""
    import torch
    import torch.distributed as dist

    from pipeoptim.links import parse_link
    from pipeoptim.models import GPTConfig, gpt_layers
    from pipeoptim.models.gpt import lm_loss
    from pipeoptim.train import Pipeline

    torch.manual_seed(0)
    first = parse_link(SETTINGS[0][1])
    pipe = Pipeline(gpt_layers(GPTConfig(**GPT), seed=0), loss_fn=lm_loss, devices=devices, schedule=schedule,
                    microbatches=MICROBATCHES, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), link=first)
    worker = pipe.workers[0]
    out = []
    for profile, spec, straggler in SETTINGS:
        pipe._runner.p2p.link = parse_link(spec)       # this benchmark switches the emulated link between phases
        worker.slowdown = straggler[1] if straggler and straggler[0] == worker.device else 1.0
        ops: dict = {}
        late: list = []
        times = []
        for step in range(warmup + steps):
            if step == warmup:
                _record(worker, ops)
                _record_lateness(pipe._runner.p2p, late)
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(_batch(step))
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if step >= warmup:
                times.append(float(took))
        for name in ("forward", "backward", "backward_weight", "step"):   # undo the timing wrappers
            worker.__dict__.pop(name, None)
        pipe._runner.p2p.__dict__.pop("_deliver", None)
        out.append({"profile": profile, "link": spec, "straggler": list(straggler) if straggler else [],
                    "times": times, "ops": [[k, s, statistics.median(v)] for (k, s), v in sorted(ops.items())],
                    "late": late})
    return out


def simulate_setting(schedule: str, per_rank: list[dict], spec: str, extra_latency_s: float = 0.0,
                     devices: int = DEVICES) -> float:
    """The simulator's makespan of ``schedule`` with the per-stage costs the ranks measured and the link (its
    latency plus ``extra_latency_s``)."""
    from pipeoptim.links import parse_link
    from pipeoptim.runtime.config import make_schedule
    from pipeoptim.sim import Costs, simulate

    sched = make_schedule(schedule, devices, MICROBATCHES)
    cost: dict = {}
    for rank in per_rank:
        for kind, stage, seconds in rank["ops"]:
            cost[(kind, stage)] = seconds
    S = sched.num_stages
    fwd = [cost[("F", k)] for k in range(S)]
    split = any(("I", k) in cost for k in range(S))
    if split:
        b_in = [cost[("I", k)] for k in range(S)]
        b_w = [cost.get(("W", k), 0.0) for k in range(S)]
        bwd = [i + w for i, w in zip(b_in, b_w)]
    else:
        bwd = [cost[("B", k)] for k in range(S)]
        b_in = b_w = None
    step = [cost.get(("S", k), 0.0) for k in range(S)]
    link = parse_link(spec)
    costs = Costs(forward=tuple(fwd), backward=tuple(bwd), step=tuple(step),
                  backward_input=None if b_in is None else tuple(b_in),
                  backward_weight=None if b_w is None else tuple(max(w, 1e-9) for w in b_w),
                  p2p_latency=link.latency_s + extra_latency_s, p2p_bandwidth=link.bandwidth_Bps,
                  activation_bytes=tuple([float(message_bytes())] * S))
    return simulate(sched, costs).makespan


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor()}, {os.cpu_count()} cores (shared)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--steps", type=int, default=4, help="timed steps per setting (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--devices", type=int, default=DEVICES, choices=(2, 4),
                   help="pipeline devices, one process each (default 4; 2 gives each process a core of this "
                        "2-core machine). The CSV keeps the rows of the other device count")
    args = p.parse_args(argv)
    from pipeoptim.runtime import launch

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "link_validation.csv")
    columns = ["schedule", "profile", "devices", "measured_s", "simulated_s", "straggler", "link", "error",
               "within_15pct", "late_ms", "simulated_late_s", "microbatches", "steps", "machine"]
    rows = []
    where = machine()
    kept = []
    if os.path.exists(path):
        with open(path, newline="") as fh:
            kept = [r for r in csv.DictReader(fh) if int(r["devices"]) != args.devices]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        for r in kept:
            w.writerow({k: r.get(k, "") for k in columns})
        for schedule in args.schedules:
            t0 = time.perf_counter()
            per_rank = launch(rank_job, args.devices, schedule, args.steps, args.warmup, args.devices, timeout_s=900)
            for i, (profile, spec, straggler) in enumerate(SETTINGS):
                measured = statistics.median(per_rank[0][i]["times"])
                simulated = simulate_setting(schedule, [r[i] for r in per_rank], spec, 0.0, args.devices)
                err = simulated / measured - 1.0
                lates = [x for r in per_rank for x in r[i]["late"]]
                late = statistics.mean(lates) if lates else 0.0
                simulated_late = simulate_setting(schedule, [r[i] for r in per_rank], spec, late, args.devices)
                row = {"schedule": schedule, "profile": profile, "devices": args.devices, "measured_s": round(measured, 4),
                       "simulated_s": round(simulated, 4),
                       "straggler": f"device {straggler[0]} x{straggler[1]:g} (emulated)" if straggler else "none",
                       "link": "emulated: " + spec, "error": round(err, 4), "within_15pct": abs(err) <= TOLERANCE,
                       "late_ms": round(late * 1e3, 3), "simulated_late_s": round(simulated_late, 4),
                       "microbatches": MICROBATCHES, "steps": args.steps, "machine": where}
                w.writerow(row)
                fh.flush()
                rows.append(row)
                print(f"{schedule:10s} {profile:18s} straggler={row['straggler']:22s} measured {measured:.3f} s  "
                      f"simulated {simulated:.3f} s  ({err:+.1%}); late {late * 1e3:.2f} ms/message, "
                      f"simulated with it {simulated_late:.3f} s", flush=True)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    met = sum(r["within_15pct"] for r in rows)
    print(f"within 15 %: {met} of {len(rows)} rows at D = {args.devices} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
