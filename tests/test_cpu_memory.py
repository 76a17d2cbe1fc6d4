"""cpu_memory.py: a stage-sized block freed by one step is reused by the next, without faulting its pages in again.

The setting is process-wide and applied once, so each case runs in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                           reason="glibc's malloc only")

# AdamW's step on one flat 6.4M-parameter buffer (a GPT stage of bench_runtime_peer.py), as the pipeline's flat
# binding hands it to torch: two 25.6 MB temporaries per step. Prints the minor page faults per step.
_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    torch.set_num_threads(1)
    if sys.argv[1] == "pipeline":
        from pipeoptim.train import Pipeline
        Pipeline(stages=lambda i: torch.nn.Linear(4, 4), devices=2, emulate=True, schedule="1f1b",
                 microbatches=2, loss_fn=lambda y, t: ((y - t) ** 2).mean(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    elif sys.argv[1] == "call":
        from pipeoptim.runtime.cpu_memory import keep_freed_memory
        print("applied", keep_freed_memory())
    flat = torch.nn.Parameter(torch.zeros(6_400_000))
    flat.grad = torch.full_like(flat, 1e-3)
    opt = torch.optim.AdamW([flat], lr=1e-4)
    for _ in range(5):
        opt.step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        opt.step()
    print("faults", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
""")


def _run(how: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", _FAULTS, how], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return dict(line.split() for line in out.stdout.splitlines())


@glibc
def test_the_flat_optimizer_step_reuses_its_temporaries_instead_of_faulting_pages_in():
    # Without the setting glibc's adaptive threshold faults in 625 to 12,468 pages per step here (it varies from
    # process to process); with it, none once the heap has grown (0.1 per step in 10 of 10 processes).
    mine = _run("call", PIPEOPTIM_CPU_MALLOC="reuse")
    assert mine["applied"] == "True"
    assert float(mine["faults"]) < 100


@glibc
def test_a_cpu_pipeline_applies_it_and_the_variable_turns_it_off():
    assert float(_run("pipeline", PIPEOPTIM_CPU_MALLOC="reuse")["faults"]) < 100
    assert _run("call", PIPEOPTIM_CPU_MALLOC="default")["applied"] == "False"


def test_a_bad_setting_is_a_clear_error_naming_the_variable_and_the_choices():
    code = textwrap.dedent("""
        import torch
        from pipeoptim.train import Pipeline
        Pipeline(stages=lambda i: torch.nn.Linear(4, 4), devices=2, emulate=True, schedule="1f1b", microbatches=2,
                 loss_fn=lambda y, t: ((y - t) ** 2).mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PIPEOPTIM_CPU_MALLOC": "fast"})
    assert out.returncode != 0
    assert "ConfigError: PIPEOPTIM_CPU_MALLOC='fast': use 'reuse'" in out.stderr and "'default'" in out.stderr
