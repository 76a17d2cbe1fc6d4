"""Compile every launch of pipeoptim_kernels' Triton backend for real GPU targets, on a machine with no GPU.

    TRITON_INTERPRET=0 python tests/triton_targets.py --arch 90 --json sm90.json

The launches are the backend's own: every rule of `kernel_reference.CONFIGS` (and the paper mode), every
fused step configuration, every output dtype, in place, ŵ over the gradient and misaligned views go
through `triton_backend`'s public functions with a recorder in place of the launch, so the kernels,
constexprs and block size are exactly what the launcher would run. Each recorded launch is then compiled
through Triton's own JIT path (`JITFunction.warmup`: argument specialisation, divisibility hints) with a
stand-in driver that reports the target, down to PTX and a cubin from ptxas. One more compile per kernel
uses a length past 2^31, which Triton passes as a 64-bit integer. One target per process: Triton keeps
the target it first saw for the life of each kernel object.

Reports one JSON record per compiled kernel with what its PTX holds (vector and scalar global accesses,
square roots and divisions by rounding mode); tests/test_triton_targets.py asserts on them. Exit status 1
when anything failed to compile. Triton caches compiled kernels: point TRITON_CACHE_DIR at an empty
folder to really compile.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("run with TRITON_INTERPRET=0: the interpreter does not compile")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from kernel_reference import CONFIGS, STEPS, optimizer_state, to_device  # noqa: E402
from pipeoptim_kernels import rules, triton_backend  # noqa: E402

LONG = (1 << 31) + 5
OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STEP_CONFIGS = [  # (rule, class, hyperparameters, completed steps)
    ("sgd", "SGD", dict(lr=0.05), 3),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.1), 0),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.1), 3),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), 0),
    ("sgd", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), 3),
    ("adam", "Adam", dict(lr=1e-2, weight_decay=0.1), 3),
    ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05, amsgrad=True), 3),
]


class TargetDriver(DriverBase):
    """Just enough of a driver for Triton's JIT to specialise and compile for `target` without a GPU."""

    def __init__(self, target: GPUTarget):
        super().__init__()
        self.target = target

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("nothing runs here: this driver only compiles")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def buffer(n: int, dtype=torch.float32, misaligned: bool = False) -> torch.Tensor:
    """A flat buffer; misaligned: a view one element in, as a view into a larger flat buffer can be."""
    t = torch.zeros(n + 1, dtype=dtype)
    return t[1:] if misaligned else t[:n]


def record_launches() -> list[tuple[str, object, list, int, list, dict]]:
    """(name, kernel, buffers, n, coefficients, constexprs) of every kernel launch the backend makes for
    the configurations above (a launch split at a misaligned head counts twice)."""
    launches = []
    current = {"name": ""}

    def recorder(kernel, buffers, n, coeffs, constexprs):
        launches.append((current["name"], kernel, list(buffers), n, list(coeffs),
                         dict(constexprs, BLOCK=triton_backend.block_size())))

    triton_backend.run_kernel, real_run = recorder, triton_backend.run_kernel
    try:
        gen = torch.Generator().manual_seed(0)
        n = 4099
        for rule, cls, hp in CONFIGS:
            for step in STEPS.get(rule, (5,)):
                _, w64, _, state64, group = optimizer_state(cls, hp, n, step, gen)
                has_paper_mode = rule in ("adam", "adamw") or (rule == "sgd" and hp.get("momentum", 0.0) > 0)
                modes = ("exact", "paper") if has_paper_mode else ("exact",)
                for mode in modes:
                    for misaligned in (False, True):
                        w = buffer(n, misaligned=misaligned).copy_(w64)
                        state = {k: (buffer(n, misaligned=misaligned).copy_(v) if v.dim() else v)
                                 for k, v in to_device(state64, "cpu").items()}
                        plan = rules.predict_plan(rule, state, group, step, 2.0, mode)
                        tag = f"predict {rule} {mode} {hp} step={step}" + (" misaligned" if misaligned else "")
                        for oname, dtype in OUT_DTYPES.items():
                            current["name"] = f"{tag} out={oname}"
                            triton_backend.predict(plan, w, buffer(n, dtype, misaligned))
                        current["name"] = f"{tag} in place"
                        triton_backend.predict(plan, w, w)
        for rule, cls, hp, step in STEP_CONFIGS:
            group = {k: v for k, v in getattr(torch.optim, cls)([torch.nn.Parameter(torch.zeros(1))], **hp)
                     .param_groups[0].items() if k != "params"}
            for misaligned in (False, True):
                w, grad = buffer(n, misaligned=misaligned), buffer(n, misaligned=misaligned)
                state = {k: buffer(n, misaligned=misaligned) for k in rules.STATE_ENTRIES[rule] if k != "grad"}
                tag = f"step_predict {rule} {hp} step={step}" + (" misaligned" if misaligned else "")
                if rule == "sgd":
                    plan = rules.sgd_step_plan(state, group, step, 2.0)
                    run = triton_backend.sgd_step_predict
                else:
                    plan = rules.adam_step_plan(rule, state, group, step, 2.0)
                    run = triton_backend.adam_step_predict
                for oname, dtype in OUT_DTYPES.items():
                    current["name"] = f"{tag} out={oname}"
                    run(plan, w, grad, buffer(n, dtype, misaligned))
                current["name"] = f"{tag} out=grad"
                run(plan, w, grad, grad)
    finally:
        triton_backend.run_kernel = real_run
    return launches


def ptx_facts(ptx: str, n_index: int) -> dict:
    """What a kernel's PTX holds: its target, global accesses by width, square roots and divisions by kind."""
    loads = re.findall(r"\bld\.global\S*", ptx)
    stores = re.findall(r"\bst\.global\S*", ptx)
    kernel = re.search(r"\.entry\s+(\w+)", ptx).group(1)
    n_param = re.search(rf"\.param\s+\.(\w+)\s+{kernel}_param_{n_index}\b", ptx)
    return {
        "target": re.search(r"\.target\s+(\S+)", ptx).group(1).rstrip(","),
        "loads_vector": sum(".v" in x for x in loads),
        "loads_scalar": sum(".v" not in x for x in loads),
        "stores_vector": sum(".v" in x for x in stores),
        "stores_scalar": sum(".v" not in x for x in stores),
        "sqrt": sorted(set(re.findall(r"\bsqrt\.[\w.]+", ptx))),
        "div": sorted(set(re.findall(r"\bdiv\.[\w.]+", ptx))),
        "rcp": sorted(set(re.findall(r"\brcp\.[\w.]+", ptx))),
        "n_param_type": n_param.group(1) if n_param else None,
    }


def compile_all(arch: int, launches) -> list[dict]:
    triton.runtime.driver.set_active(TargetDriver(GPUTarget("cuda", arch, 32)))
    jobs = [(name, kernel, buffers, n, coeffs, consts, False) for name, kernel, buffers, n, coeffs, consts in launches]
    firsts = {}
    for launch in launches:  # one launch past 2^31 elements per kernel
        firsts.setdefault(launch[1], launch)
    for name, kernel, buffers, n, coeffs, consts in firsts.values():
        jobs.append((f"{name} n=2^31+5", kernel, buffers, LONG, coeffs, consts, True))
    records, seen = [], {}
    for name, kernel, buffers, n, coeffs, consts, long in jobs:
        t0 = time.time()
        record = {"arch": arch, "name": name, "kernel": kernel.fn.__name__, "n": n, "long": long,
                  "aligned": all(b.data_ptr() % 16 == 0 for b in buffers),
                  "out_dtype": str(buffers[-1].dtype).replace("torch.", "")}
        try:
            compiled = kernel.warmup(*buffers, n, *coeffs, grid=(1,), **consts)
        except Exception as e:  # every failure is reported, the others still compile
            record.update(ok=False, error="".join(traceback.format_exception_only(type(e), e)).strip()[-2000:])
            records.append(record)
            continue
        key = id(compiled)
        record.update(ok=True, seconds=round(time.time() - t0, 3), cubin_bytes=len(compiled.asm["cubin"]),
                      duplicate_of=seen.get(key), **ptx_facts(compiled.asm["ptx"], len(buffers)))
        seen.setdefault(key, name)
        records.append(record)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10, e.g. 80 or 90")
    ap.add_argument("--json", default=None, help="write the records here (JSON list)")
    args = ap.parse_args(argv)
    t0 = time.time()
    launches = record_launches()
    records = compile_all(args.arch, launches)
    failed = [r for r in records if not r["ok"]]
    distinct = [r for r in records if r["ok"] and r["duplicate_of"] is None]
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(launches)} launches recorded, "
          f"{len(distinct)} distinct kernels compiled for sm_{args.arch}, "
          f"{len(failed)} failed, {time.time() - t0:.1f} s")
    for r in failed:
        print(f"FAILED sm_{r['arch']} {r['name']}:\n{r['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
