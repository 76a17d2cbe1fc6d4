"""Cross-check with torch.distributed.pipelining: our gpipe/1f1b/interleaved orders and the split-backward ones
(zb-h1, zbv, dualpipev: I and W actions), exported as torch's per-rank action CSV, are accepted and executed by
torch's own runtime on gloo, and give the gradients of single-process training; and our 1F1B / interleaved /
ZB-H1 / ZBV / DualPipeV orders equal torch's built-in ones (same compute sequence per rank; torch only adds idle
slots for its grid and REDUCE_GRAD markers)."""
from __future__ import annotations

import csv
import os
import re
import socket
from datetime import timedelta

import pytest
import torch

from pipeoptim.schedules import get_schedule
from pipeoptim.schedules.torch_export import to_torch_csv, to_torch_rows, torch_runtime_available

AVAILABLE, WHY = torch_runtime_available()
needs_torch_runtime = pytest.mark.skipif(not AVAILABLE, reason=WHY or "torch pipelining runtime unavailable")
WIDTH, ROWS_PER_MB, SEED = 6, 2, 1234


def _stages(n_stages: int) -> list[torch.nn.Module]:
    torch.manual_seed(SEED)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(n_stages)]


def _data(n_micro: int):
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(n_micro * ROWS_PER_MB, WIDTH, generator=g)
    y = torch.randn(n_micro * ROWS_PER_MB, WIDTH, generator=g)
    return x, y


def _loss(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _reference_grads(n_stages: int, n_micro: int) -> dict[int, list[torch.Tensor]]:
    """Single-process training: mean over micro-batches of the per-micro-batch loss (torch's scale_grads)."""
    stages = _stages(n_stages)
    model = torch.nn.Sequential(*stages)
    x, y = _data(n_micro)
    total = sum(_loss(model(xm), ym) for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro))) / n_micro
    total.backward()
    return {k: [p.grad.clone() for p in st.parameters()] for k, st in enumerate(stages)}


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, int, int, str]]) -> None:
    """One rank: for each (csv, microbatches, stages, out) job, run torch's runtime on our CSV, save grads."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for csv_path, n_micro, n_stages, out in jobs:
            with open(csv_path) as f:
                rows = list(csv.reader(f))
            mine = sorted({int(re.match(r"\d+", t).group(0)) for t in rows[rank] if t})
            modules = _stages(n_stages)
            stages = [PipelineStage(modules[k], k, n_stages, torch.device("cpu"), group=dist.group.WORLD)
                      for k in mine]
            runtime = _PipelineScheduleRuntime(stages, n_micro, loss_fn=_loss)
            runtime._load_csv(csv_path)
            x, y = _data(n_micro)
            args = (x,) if 0 in mine else ()
            runtime.step(*args, target=y if n_stages - 1 in mine else None)
            torch.save({k: [p.grad for p in modules[k].parameters()] for k in mine}, out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rows_are_torch_tokens_in_our_order():
    s = get_schedule("1f1b", devices=2, microbatches=3)
    assert to_torch_rows(s) == [["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
                                ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]]
    assert to_torch_csv(s).splitlines()[0] == "0F0,0F1,0B0,0F2,0B1,0B2"


def test_two_replica_schedules_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="two model replicas"):
        to_torch_rows(get_schedule("bitpipe", devices=2, microbatches=2))


@needs_torch_runtime
@pytest.mark.parametrize("name,devices,microbatches,chunks", [
    ("gpipe", 2, 3, None), ("1f1b", 4, 2, None), ("1f1b", 3, 7, None), ("interleaved", 2, 4, 2),
    ("interleaved", 4, 8, 3), ("zb-h1", 4, 6, None), ("zbv", 4, 5, None), ("dualpipev", 4, 9, None)])
def test_torch_validator_accepts_our_orders(name, devices, microbatches, chunks):
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule
    s = get_schedule(name, devices, microbatches, chunks=chunks)
    actions = {r: [_Action.from_str(t) for t in row] for r, row in enumerate(to_torch_rows(s))}
    mapping = _validate_schedule(actions, devices, s.num_stages, microbatches)
    assert mapping == {k: s.device_of(k) for k in range(s.num_stages)}


def _compute_only(order) -> list[str]:
    return [str(a) for a in order if a is not None and str(a)[-1].isdigit() and ("F" in str(a) or "B" in str(a))
            and "REDUCE" not in str(a)]


def _shift_forwards(row: list[str]) -> list[str]:
    return [re.sub(r"F(\d+)$", lambda m: f"F{int(m.group(1)) + 1}", t) for t in row]


@needs_torch_runtime
@pytest.mark.parametrize("devices,microbatches", [(2, 2), (4, 4), (4, 8), (8, 12)])
def test_our_1f1b_is_torchs_1f1b(devices, microbatches):
    """torch's Schedule1F1B runs warm-up min(N, D-rank) forwards then backward/forward pairs: the same sequence
    as ours (D-rank-1 warm-up forwards, then forward/backward pairs). Its drawn order (_get_pipeline_order)
    agrees on every rank but the last, where torch 2.14 numbers forwards from 1 (it never lists F0 and lists a
    forward of micro-batch N that does not exist); accept that known off-by-one, or the fixed order. With N < D-1
    the drawn order also lists D-rank-1 warm-up forwards without capping them at N, so only N >= D is compared."""
    from torch.distributed.pipelining.schedules import Schedule1F1B
    fake = Schedule1F1B.__new__(Schedule1F1B)  # only the order generator is used: no stages, no process group
    fake._num_stages, fake._n_microbatches = devices, microbatches
    try:
        theirs = fake._get_pipeline_order()
    except AttributeError as e:
        pytest.skip(f"torch's Schedule1F1B order generator needs other private state in this version: {e}")
    ours = to_torch_rows(get_schedule("1f1b", devices, microbatches))
    drawn = [_compute_only(theirs[r]) for r in range(devices)]
    assert drawn[:-1] == ours[:-1]
    assert drawn[-1] in (ours[-1], _shift_forwards(ours[-1]))


@needs_torch_runtime
@pytest.mark.parametrize("devices,microbatches,chunks", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2)])
def test_our_interleaved_is_torchs_interleaved(devices, microbatches, chunks):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    fake = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    fake.pp_group_size, fake.n_local_stages, fake._n_microbatches = devices, chunks, microbatches
    fake.number_of_rounds = max(1, microbatches // devices)
    fake.microbatches_per_round = microbatches // fake.number_of_rounds
    try:
        theirs = [fake._calculate_single_rank_operations(r) for r in range(devices)]
    except AttributeError as e:
        pytest.skip(f"torch's interleaved order generator needs other private state in this version: {e}")
    ours = to_torch_rows(get_schedule("interleaved", devices, microbatches, chunks=chunks))
    assert [_compute_only(t) for t in theirs] == ours


def _flat_order(order) -> list[str]:
    """torch's drawn order as our tokens: idle slots dropped, an overlapped forward/backward pair unpacked."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B
    out = []
    for a in order:
        if a is None:
            continue
        out += [str(x) for x in a.sub_actions] if a.computation_type == OVERLAP_F_B else [str(a)]
    return out


@needs_torch_runtime
@pytest.mark.parametrize("devices", [2, 3, 4, 8])
def test_our_zero_bubble_orders_are_torchs(devices):
    """ZB-H1 equals torch's ZB1P with one stage per rank, ZBV its ScheduleZBVZeroBubble, DualPipeV its
    ScheduleDualPipeV, for every N from 1 (2D for DualPipeV) to 3D+1; only their order generators are called."""
    from torch.distributed.pipelining import schedules as ts
    D = devices
    try:
        for N in range(1, 3 * D + 2):
            zbv = ts.ScheduleZBVZeroBubble.__new__(ts.ScheduleZBVZeroBubble)
            zbv.pp_group_size, zbv._n_microbatches, zbv.num_stages = D, N, 2 * D
            assert [_flat_order(zbv._calculate_single_rank_operations(r)) for r in range(D)] == \
                to_torch_rows(get_schedule("zbv", D, N)), f"zbv N={N}"
            zb1 = ts.ScheduleInterleavedZeroBubble.__new__(ts.ScheduleInterleavedZeroBubble)
            zb1.pp_group_size, zb1._n_microbatches, zb1.n_local_stages = D, N, 1
            zb1.number_of_rounds = max(1, N // D)
            zb1.microbatches_per_round = N // zb1.number_of_rounds
            assert [_flat_order(zb1._calculate_single_rank_operations(r)) for r in range(D)] == \
                to_torch_rows(get_schedule("zb-h1", D, N)), f"zb-h1 N={N}"
            if N >= 2 * D:
                dpv = ts.ScheduleDualPipeV.__new__(ts.ScheduleDualPipeV)
                dpv.pp_group_size, dpv._n_microbatches, dpv.num_stages = D, N, 2 * D
                assert [_flat_order(dpv._calculate_single_rank_operations(r)) for r in range(D)] == \
                    to_torch_rows(get_schedule("dualpipev", D, N)), f"dualpipev N={N}"
    except AttributeError as e:
        pytest.skip(f"torch's zero-bubble order generators need other private state in this version: {e}")


def _check_runtime(world: int, cases, tmp_path) -> None:
    jobs = []
    for i, (name, microbatches, chunks) in enumerate(cases):
        s = get_schedule(name, world, microbatches, chunks=chunks)
        path = tmp_path / f"{i}_{name}.csv"
        path.write_text(to_torch_csv(s))
        jobs.append((str(path), microbatches, s.num_stages, str(tmp_path / f"{i}_{name}_rank{{}}.pt")))
    # each rank writes its own file: substitute the rank number in the output name
    per_rank = [[(c, n, st, out.format(r)) for c, n, st, out in jobs] for r in range(world)]
    _run_ranks(world, per_rank)
    for (name, microbatches, chunks), (_, _, n_stages, out) in zip(cases, jobs):
        expected = _reference_grads(n_stages, microbatches)
        got: dict = {}
        for r in range(world):
            got.update(torch.load(out.format(r)))
        assert sorted(got) == list(range(n_stages)), f"{name}: stages {sorted(got)} came back"
        for k in range(n_stages):
            for g, e in zip(got[k], expected[k]):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=f"{name}: stage {k} gradient")


def _rank_main(rank: int, world: int, port: int, jobs: list) -> None:
    torch.set_num_threads(1)
    try:
        _worker(rank, world, port, jobs)
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _run_ranks(world: int, per_rank_jobs: list, timeout: float = 60.0) -> None:
    """Start ``world`` ranks from a fork server that has imported torch (seconds instead of a fresh import per
    rank, and never a fork of this process: torch 2.11 refuses autograd in a child forked after the parent ran
    it); kill them all if any fails or time runs out, so a hang fails the test instead of blocking."""
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining", "pipeoptim.schedules"])
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, per_rank_jobs[r]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} did not finish within {timeout}s (hang)"
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        assert not failed, f"ranks exited with errors (rank, exit code): {failed}; see captured stderr"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@needs_torch_runtime
@pytest.mark.slow
def test_torch_runtime_runs_our_orders_on_two_ranks(tmp_path):
    _check_runtime(2, [("gpipe", 3, None), ("1f1b", 4, None), ("interleaved", 4, 2)], tmp_path)


@needs_torch_runtime
@pytest.mark.slow
def test_torch_runtime_runs_our_orders_on_four_ranks(tmp_path):
    _check_runtime(4, [("1f1b", 2, None), ("interleaved", 4, 2)], tmp_path)


# torch 2.11's runtime opens a stage's links with a p2p send to the next stage's rank even when that rank is its
# own, as in a V-shape order (stages D-1 and D on the last rank): gloo fails ("Pair is not connected ... <-->
# [none]"). torch 2.14 skips local neighbours; 2.12 and 2.13 are untested, so the V orders run from 2.14 on.
TORCH_RUNS_V_ORDERS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
needs_v_orders = pytest.mark.skipif(not TORCH_RUNS_V_ORDERS, reason=f"torch {torch.__version__}'s pipelining "
                                    "runtime sends to its own rank when one rank holds two adjacent stages")


@needs_torch_runtime
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_torch_runtime_runs_our_zb_h1_order(world, tmp_path):
    """torch executes our I/W actions (its BACKWARD_INPUT / BACKWARD_WEIGHT) with the gradients of plain training."""
    _check_runtime(world, [("zb-h1", world + 2, None)], tmp_path)


@needs_torch_runtime
@needs_v_orders
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_torch_runtime_runs_our_v_shape_split_backward_orders(world, tmp_path):
    _check_runtime(world, [("zbv", 2 * world, None), ("dualpipev", 2 * world, None)], tmp_path)
