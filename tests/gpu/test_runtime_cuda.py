"""The runtime on the GPU: a one-rank job on NCCL (the backend of every multi-GPU job; NCCL reduces no CPU
tensors, so this is where a collective on the wrong device shows) and the emulator, both on CUDA tensors, take
the same steps. In the CPU dry run the same code runs on gloo and CPU tensors."""
import math

import pytest
import torch

import runtime_cases as rc
from pipeoptim.runtime import launch


@pytest.mark.parametrize("schedule,policy", [("1f1b", None), ("async-1f1b", "none")])
def test_a_one_rank_job_on_the_device_takes_the_emulators_steps(schedule, policy, gpu):
    [ran] = launch(rc.one_device_job, 1, gpu.device, schedule, policy, False, timeout_s=300)
    emulated = rc.one_device_job(gpu.device, schedule, policy, True)
    assert ran["losses"] == pytest.approx(emulated["losses"], rel=1e-6)
    assert all(math.isfinite(v) for v in ran["losses"]) and ran["losses"][-1] < ran["losses"][0]
    for name, value in emulated["params"].items():
        torch.testing.assert_close(ran["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    if schedule == "1f1b":
        assert ran["stats"]["grad_norm"] == pytest.approx(emulated["stats"]["grad_norm"], rel=1e-6)
    assert ran["stats"]["nonfinite"] == 0
