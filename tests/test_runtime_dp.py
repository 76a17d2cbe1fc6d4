"""Data x pipeline parallel (``Pipeline(dp=2)``), proven: 2 pipeline replicas x 4 stages as 8 gloo processes
against one emulated pipeline of 4 devices (``runtime.data_parallel`` documents the semantics).

- Synchronous schedules (1F1B, interleaved, Chimera and BitPipe with their mirror all-reduces, tied weights across
  stages and within a device, global-norm clipping): the weights, the global gradient norm and the loss after
  each step equal those of ONE pipeline trained on the replicas' batches concatenated (replica q's rows
  q*B..(q+1)*B-1).
- Asynchronous schedules (async 1F1B under PipeOptim and under weight stashing, PipeDream-2BW): every stage's
  step averages that stage's gradient over the replicas at the same step index, so the weights equal one
  pipeline whose micro-batch j holds both replicas' micro-batch j (mean loss over 2b rows = the average of two
  means over b).
- Every replica holds bit-identical weights after every step, and every rank returns the same loss.
- A NaN in one replica's data skips that update on every replica (counted once), as in the single pipeline.
One launch runs every case (starting 8 processes is most of its ~25 s on 2 cores; a case costs ~0.3 s after the
first); the checks run here against the emulator.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim.runtime import launch
from pipeoptim.schedules.actions import Sync

D, DP, N, B, WIDTH, STEPS = 4, 2, 4, 8, 8, 3  # B rows per replica per step: micro-batches of 2 rows
CLIP = 0.02  # well below the gradient norms here (asserted), so clipping acts on every step


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def blocks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block() for _ in range(n)]


def mse(y, t):
    return nn.functional.mse_loss(y, t)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


# name -> (schedule, policy, layers, Pipeline keyword arguments); the NaN case poisons replica 1's step 1
CASES = {
    "1f1b": ("1f1b", None, 4, {}),
    "1f1b-tied-clip": ("1f1b", None, 4, dict(tied=[("0.lin.weight", "3.lin.weight")], clip_norm=CLIP)),
    "chimera-clip": ("chimera", None, 4, dict(clip_norm=CLIP)),
    "bitpipe-tied-clip": ("bitpipe", None, 8, dict(tied=[("0.lin.weight", "7.lin.weight")], clip_norm=CLIP)),
    "interleaved-clip": ("interleaved", None, 8, dict(clip_norm=CLIP)),  # two chunks per device, no mirror
    "async-pipeoptim": ("async-1f1b", "pipeoptim", 4, {}),
    "2bw": ("2bw", "2bw", 4, {}),  # a step every 4 backwards: the accumulated gradient is averaged
    "async-stash-clip": ("async-1f1b", "stash", 4, dict(clip_norm=CLIP)),
    "1f1b-nan": ("1f1b", None, 4, dict(on_nonfinite="skip")),
    # the executor's own averaging at the step, for schedules built without the data-parallel syncs
    "bitpipe-tied-clip-at-step": ("bitpipe", None, 8, dict(tied=[("0.lin.weight", "7.lin.weight")], clip_norm=CLIP,
                                                          schedule_options=dict(data_parallel=False))),
    "async-stash-clip-at-step": ("async-1f1b", "stash", 4, dict(clip_norm=CLIP,
                                                                schedule_options=dict(data_parallel=False))),
}
ASYNC = [k for k, c in CASES.items() if c[0] in ("async-1f1b", "2bw")]
SYNC = [k for k in CASES if k not in ASYNC]


def global_batch(step: int, name: str):
    """The 2B rows both replicas see at ``step``: replica q takes rows q*B..(q+1)*B-1."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(DP * B, WIDTH, generator=g), torch.randn(DP * B, WIDTH, generator=g)
    if name.endswith("-nan") and step == 1:
        x[B + 1, 0] = float("nan")  # replica 1 only
    return x, y


def pipeline(name: str, emulate: bool):
    from pipeoptim.train import Pipeline
    schedule, policy, n, kw = CASES[name]
    return Pipeline(blocks(n), loss_fn=mse, optimizer=sgd, schedule=schedule, policy=policy, microbatches=N,
                    devices=D, emulate=emulate, dp=1 if emulate else DP, **kw)


def dp_job(names):
    """Rank side: every case in turn, replica ``pipe.dp_rank`` on its share of each global batch."""
    import warnings

    from pipeoptim.runtime.data_parallel import replica_rows
    out = []
    for name in names:
        pipe = pipeline(name, emulate=False)
        losses, norms, skipped = [], [], []
        for step in range(STEPS):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the NaN case's 'skip' warning
                losses.append(pipe.train_step(replica_rows(global_batch(step, name), pipe.dp_rank, pipe.dp)))
            norms.append(pipe.last_stats["grad_norm"])
            skipped.append(pipe.last_stats["nonfinite"])
        out.append({"params": {k: v.detach().clone() for k, v in pipe.named_parameters().items()},
                    "losses": losses, "norms": norms, "skipped": skipped, "dp_rank": pipe.dp_rank,
                    "dp_syncs": sum(isinstance(a, Sync) and a.dp for a in pipe.plan.actions[pipe.workers[0].device])})
    return out


def paired_microbatches(batch):
    """The single pipeline's batch whose micro-batch j is (replica 0's micro-batch j, replica 1's)."""
    x, y = batch
    order = torch.arange(DP * B).view(DP, N, B // N).transpose(0, 1).reshape(-1)
    return x[order], y[order]


def reference(name: str):
    """One emulated pipeline of D devices on the global batches (paired per micro-batch for async)."""
    import warnings
    pipe = pipeline(name, emulate=True)
    losses, norms, skipped = [], [], []
    for step in range(STEPS):
        batch = global_batch(step, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            losses.append(pipe.train_step(paired_microbatches(batch) if name in ASYNC else batch))
        norms.append(pipe.last_stats["grad_norm"])
        skipped.append(pipe.last_stats["nonfinite"])
    return {k: v.detach().clone() for k, v in pipe.named_parameters().items()}, losses, norms, skipped


def normed_blocks() -> list[nn.Module]:
    """Linear, BatchNorm, Linear, BatchNorm: running statistics that differ between the replicas."""
    torch.manual_seed(0)
    return [Block(), nn.BatchNorm1d(WIDTH), Block(), nn.BatchNorm1d(WIDTH)]


def normed_pipeline(emulate: bool):
    from pipeoptim.train import Pipeline
    return Pipeline(normed_blocks(), loss_fn=mse, optimizer=sgd, schedule="1f1b", microbatches=N, devices=D,
                    emulate=emulate, dp=1 if emulate else DP)


def trained_normed_pipeline(emulate: bool, steps: int = 2):
    from pipeoptim.runtime.data_parallel import replica_rows
    pipe = normed_pipeline(emulate)
    for step in range(steps):
        pipe.train_step(global_batch(step, "") if emulate else replica_rows(global_batch(step, ""), pipe.dp_rank, DP))
    return pipe


def own_state(pipe) -> dict:
    """This rank's parameters and buffers, by global name."""
    return {"params": {k: v.detach().clone() for k, v in pipe.named_parameters().items()},
            "buffers": pipe.state_dict()["buffers"]}


def checkpoint_job(root: str) -> dict:
    """Rank side: a dp=2 run saves; a fresh dp=2 pipeline resumes it and takes the next step beside the run; a
    third loads ``root/dp1``, written by one pipeline before the launch."""
    import os

    from pipeoptim.runtime.data_parallel import replica_rows
    pipe = trained_normed_pipeline(emulate=False)
    saved = own_state(pipe)
    pipe.save(os.path.join(root, "dp2"))
    resumed = normed_pipeline(emulate=False)
    resumed.load(os.path.join(root, "dp2"))
    out = {"saved": saved, "resumed": own_state(resumed)}
    batch = replica_rows(global_batch(2, ""), pipe.dp_rank, DP)
    out["next_loss"], out["next_loss_resumed"] = pipe.train_step(batch), resumed.train_step(batch)
    from_one = normed_pipeline(emulate=False)
    from_one.load(os.path.join(root, "dp1"))
    out["from_one_pipeline"] = own_state(from_one)
    return out


def ranks_job(names, root):
    return {"cases": dp_job(names), "checkpoint": checkpoint_job(root)}


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_checkpoints")
    one = trained_normed_pipeline(emulate=True)
    one.save(str(root / "dp1"))
    return root, launch(ranks_job, D * DP, list(CASES), str(root), timeout_s=240), own_state(one)


@pytest.fixture(scope="module")
def dp_results(dp_run):
    results = [r["cases"] for r in dp_run[1]]
    return {name: [r[i] for r in results] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_dp2_x_4_stages_equals_one_pipeline_on_the_doubled_batch(name, dp_results, one_thread):
    ranks = dp_results[name]
    assert [r["dp_rank"] for r in ranks] == [0] * D + [1] * D  # rank = dp_rank * devices + pipeline device
    for d in range(D):  # the replicas hold bit-identical weights
        a, b = ranks[d]["params"], ranks[D + d]["params"]
        assert set(a) == set(b) and a
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    for r in ranks[1:]:  # one loss, one norm, one count on every rank
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(ranks[0][key]), rtol=0, atol=0,
                                       equal_nan=True)
        assert r["skipped"] == ranks[0]["skipped"]
    got = {}
    for r in ranks[:D]:
        got.update(r["params"])
    params, losses, norms, skipped = reference(name)
    assert set(got) == set(params)
    for k, v in params.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-5, nan_ok=True)
    assert ranks[0]["skipped"] == skipped
    if name in SYNC:
        assert ranks[0]["norms"] == pytest.approx(norms, rel=1e-5, nan_ok=True)
    if "-clip" in name and name in SYNC:
        assert min(norms) > 2 * CLIP  # clipping did act, so the norm had to be the whole pipeline's
    at_step = name.endswith("-at-step")  # else the schedule holds the replicas' all-reduces (with_data_parallel)
    assert all((r["dp_syncs"] == 0) == at_step for r in ranks)
    if name.endswith("-nan"):
        assert skipped == [0, D, 0]  # one skipped update per stage, not one per stage and replica


def test_tied_copies_stay_equal_under_dp(dp_results):
    for name, (a, b) in [("1f1b-tied-clip", ("0.lin.weight", "3.lin.weight")),
                         ("bitpipe-tied-clip", ("0.lin.weight", "7.lin.weight")),
                         ("bitpipe-tied-clip-at-step", ("0.lin.weight", "7.lin.weight"))]:
        got = {}
        for r in dp_results[name]:
            got.update(r["params"])
        assert torch.equal(got[a], got[b]), name


def test_data_parallel_syncs_of_a_single_replica_change_nothing(one_thread):
    # Pipeline(dp=2) builds its schedule with_data_parallel; for one replica those Syncs are no-ops
    from pipeoptim.train import Pipeline
    schedule, _, n, kw = CASES["bitpipe-tied-clip"]
    plain, synced = (Pipeline(blocks(n), loss_fn=mse, optimizer=sgd, schedule=schedule, microbatches=N, devices=D,
                              emulate=True, schedule_options=dict(data_parallel=dp), **kw) for dp in (False, True))
    assert any(a.dp for row in synced.plan.actions for a in row if isinstance(a, Sync))
    for step in range(2):
        assert plain.train_step(global_batch(step, "")) == synced.train_step(global_batch(step, ""))
    for k, v in plain.named_parameters().items():
        assert torch.equal(v, synced.named_parameters()[k]), k


def test_a_dp_checkpoint_holds_the_model_once_and_each_replicas_statistics(dp_run):
    from pipeoptim.runtime import checkpoint_files as files
    from pipeoptim.runtime.checkpoint import read
    root, ranks, _ = dp_run
    (step_dir,) = (root / "dp2").glob("step-*")
    assert files.verify(str(step_dir))["dp"] == 2
    parts = [read(str(step_dir / f"part-{r}.pt")) for r in range(D * DP)]
    names = set()
    for r, part in enumerate(parts):
        assert part["dp_rank"] == r // D
        assert bool(part["buffers"]) == (r % D in (1, 3))  # the BatchNorm stages keep their replica's statistics
        if r < D:
            assert part["params"] and part["opt_state"] and not names & set(part["params"])
            names |= set(part["params"])
        else:  # replica 1 holds the same weights and optimizer state: not written again
            assert part["params"] == part["opt_state"] == part["policy_state"] == {}
    assert names == set(normed_pipeline(emulate=True).named_parameters())
    for d in range(D):  # (the statistics being kept apart do differ)
        if ranks[d]["checkpoint"]["saved"]["buffers"]:
            a, b = (ranks[q * D + d]["checkpoint"]["saved"]["buffers"] for q in range(DP))
            assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith("running_mean"))


def test_a_dp_run_resumes_exactly_each_replica_its_own_statistics(dp_run):
    for r in dp_run[1]:
        ck = r["checkpoint"]
        for kind in ("params", "buffers"):
            saved, resumed = ck["saved"][kind], ck["resumed"][kind]
            assert set(saved) == set(resumed) and all(torch.equal(saved[k], resumed[k]) for k in saved), kind
        assert ck["next_loss_resumed"] == ck["next_loss"]


def test_a_dp_checkpoint_resumes_into_one_pipeline_and_one_pipelines_into_dp(dp_run, one_thread):
    root, ranks, written = dp_run  # written: what root/dp1 holds
    one = normed_pipeline(emulate=True)
    one.load(str(root / "dp2"))
    mine = own_state(one)
    replica0 = {kind: {k: v for r in ranks[:D] for k, v in r["checkpoint"]["saved"][kind].items()}
                for kind in ("params", "buffers")}
    for kind in ("params", "buffers"):
        assert set(mine[kind]) == set(replica0[kind]) and all(torch.equal(mine[kind][k], replica0[kind][k])
                                                                for k in mine[kind]), kind
    for q in range(DP):  # each replica, all its ranks together, holds the one pipeline's values
        for kind in ("params", "buffers"):
            got = {k: v for r in ranks[q * D:(q + 1) * D]
                   for k, v in r["checkpoint"]["from_one_pipeline"][kind].items()}
            assert set(got) == set(written[kind]) and all(torch.equal(v, written[kind][k]) for k, v in got.items())
