"""pipeoptim_kernels/_build.py and setup.py: finding the CUDA toolkit (or building the CPU kernels alone, with
one warning), the flags the extension is built with, and what the build produced."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from pipeoptim_kernels import _build, compiled
from venv_helpers import make_venv_seeing_this_environment


def _archs(flags: list[str]) -> set[str]:
    return set(re.findall(r"(?:sm|compute)_(\d+)", " ".join(flags)))


def test_torch_cuda_arch_list_picks_the_gpu_targets(monkeypatch):
    """TORCH_CUDA_ARCH_LIST=9.0 (the lent H200 alone) builds sm_90 only: torch adds its -gencode flags
    unless ours already name an arch, in which case it silently ignores the list."""
    for wanted, archs in (("9.0", {"90"}), ("8.0;9.0", {"80", "90"})):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", wanted)
        flags = list(_build.NVCC_FLAGS)
        assert _archs(flags + cpp_extension._get_cuda_arch_flags(flags)) == archs


def test_built_extension_holds_code_for_each_requested_gpu():
    """The CUDA kernels compile in every CI run: the extension holds a cubin for each requested target."""
    module = compiled.load()
    if module is None or not module.with_cuda:
        pytest.skip("the extension was built without CUDA (no nvcc or a CPU build of torch)")
    if _build.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to list the extension's GPU code")
    assert _build.cubin_archs(module.__file__) == _build.requested_cuda_archs()
    assert torch.version.cuda is not None


def test_stale_reason_says_why_a_build_is_needed(monkeypatch, tmp_path):
    """What gpu_check.sh's build step asks before building: nothing built, a source newer than the build,
    a missing GPU target; None for the extension this suite runs on (built after its sources)."""
    if compiled.load() is None:
        pytest.skip("the extension is not built")
    assert _build.stale_reason() is None
    with monkeypatch.context() as nothing_built:
        nothing_built.setattr(_build, "ROOT", tmp_path)
        nothing_built.delenv("PIPEOPTIM_KERNELS_BUILD", raising=False)
        (tmp_path / "pipeoptim_kernels").mkdir()
        assert _build.stale_reason() == "not built"
    if compiled.load().with_cuda and _build.cuobjdump():
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5;9.0")
        assert "sm_75" in _build.stale_reason()
    newer = tmp_path / "rules.h"
    newer.write_text("// touched\n")
    monkeypatch.setattr(_build, "CSRC", tmp_path)
    assert "rules.h changed after" in _build.stale_reason()


# --- Finding the CUDA toolkit, and the CPU-only fallback -------------------------------------------------

_FAKE_NVCC = """#!{python}
# A stand-in for a CUDA {release} nvcc: says where it is on a dry run, its release on --version, and
# "compiles" (an empty object, from the host compiler) anything else unless {fail} is set; logs its arguments.
import os, subprocess, sys
here = os.path.dirname(os.path.realpath(__file__))
args = sys.argv[1:]
with open(os.path.join(here, "calls.log"), "a") as log:
    log.write(" ".join(args) + "\\n")
if "--dryrun" in args:
    print("#$ _HERE_=" + here)
elif "--version" in args:
    print("Cuda compilation tools, release {release}, V{release}.88")
elif {fail}:
    sys.exit("nvcc fatal   : this fake nvcc fails every compile")
else:
    obj = args[args.index("-o") + 1]
    sys.exit(subprocess.run(["c++", "-fPIC", "-x", "c++", "-c", os.devnull, "-o", obj]).returncode)
"""


def _fake_toolkit(root, release="13.0", fail=False):
    """A toolkit folder with bin/nvcc (the stand-in above), include/cuda_runtime.h, lib64/libcudart.so (a real,
    empty shared library, so the host compiler can link against it)."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "lib64").mkdir()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(_FAKE_NVCC.format(python=sys.executable, release=release, fail=fail))
    nvcc.chmod(0o755)
    (root / "include" / "cuda_runtime.h").write_text("// fake\n")
    subprocess.run(["c++", "-shared", "-x", "c++", os.devnull, "-o", str(root / "lib64" / "libcudart.so")], check=True)
    return root


def _wrapper(folder, target):
    """An nvcc outside the toolkit that runs the real one, like /usr/local/bin/nvcc on the lent machines."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture
def bare_env(monkeypatch, tmp_path):
    """No CUDA_HOME/CUDA_PATH, a PATH of system tools only, no /usr/local/cuda, torch claiming CUDA 13.0."""
    for var in ("CUDA_HOME", "CUDA_PATH", "PIPEOPTIM_NO_CUDA", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(_build, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda-here"), raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return monkeypatch


def test_an_nvcc_wrapper_on_path_leads_to_the_toolkit_it_runs(bare_env, tmp_path):
    """The bug: the wrapper's folder's parent (/usr/local) was taken as the toolkit, and the link failed
    with `cannot find -lcudart` after the whole compile. The toolkit is the one the wrapper runs."""
    toolkit = _fake_toolkit(tmp_path / "cuda-13.0")
    wrapper = _wrapper(tmp_path / "local" / "bin", toolkit / "bin" / "nvcc")
    bare_env.setenv("PATH", f"{wrapper.parent}:/usr/bin:/bin")
    assert _build.cuda_home() == str(toolkit)
    bare_env.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    plan = _build.cuda_plan()
    assert plan.with_cuda and plan.home == str(toolkit) and not plan.warn
    assert f"the nvcc on PATH, {wrapper}, runs {toolkit / 'bin' / 'nvcc'}" in plan.reason
    # the probe compiled for the requested target, through the toolkit's own nvcc
    assert "-gencode=arch=compute_90,code=sm_90" in (toolkit / "bin" / "calls.log").read_text()
    line = _build.describe(plan)
    assert f"CUDA toolkit at {toolkit}" in line and "TORCH_CUDA_ARCH_LIST=9.0" in line and "WARNING" not in line
    bare_env.setenv("MAX_JOBS", "1")
    assert "MAX_JOBS=1" in _build.describe(plan)


def test_a_symlinked_nvcc_is_followed_too(bare_env, tmp_path):
    toolkit = _fake_toolkit(tmp_path / "cuda")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    bare_env.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    assert _build.cuda_home() == str(toolkit)


@pytest.mark.parametrize("broken", ["no nvcc", "no header", "no libcudart"])
def test_cuda_home_naming_no_usable_toolkit_builds_the_cpu_kernels_with_one_warning(bare_env, tmp_path, broken):
    """An explicit CUDA_HOME is the user's choice: checked, never silently replaced by another toolkit.
    (No libcudart: the test link fails as the build's would, with the linker's own words.)"""
    if broken == "no libcudart" and subprocess.run(["c++", "-shared", "-x", "c++", os.devnull, "-lcudart", "-o",
                                                     str(tmp_path / "t.so")], capture_output=True).returncode == 0:
        pytest.skip("this linker finds a libcudart in its own folders: a toolkit without one links anyway")
    home = _fake_toolkit(tmp_path / "cuda")
    {"no nvcc": home / "bin" / "nvcc", "no header": home / "include" / "cuda_runtime.h",
     "no libcudart": home / "lib64" / "libcudart.so"}[broken].unlink()
    other = _fake_toolkit(tmp_path / "other")
    bare_env.setenv("PATH", f"{other / 'bin'}:/usr/bin:/bin")
    bare_env.setenv("CUDA_HOME", str(home))
    plan = _build.cuda_plan()
    assert not plan.with_cuda and plan.warn
    said = {"no nvcc": f"CUDA_HOME={home}, but {home} has no bin/nvcc",
            "no header": f"CUDA_HOME={home}, but {home} has no include/cuda_runtime.h",
            "no libcudart": f"CUDA_HOME={home}: a test link failed"}[broken]
    assert said in plan.reason
    if broken == "no libcudart":
        assert "-lcudart" in plan.reason
    line = _build.describe(plan)
    assert line.count("WARNING") == 1 and "building the CPU kernels only" in line
    assert "set CUDA_HOME to a CUDA 13.x toolkit" in line and "PIPEOPTIM_NO_CUDA=1" in line


def test_torchs_own_guess_is_taken_where_the_wrapped_nvcc_lives_apart_from_the_headers(bare_env, tmp_path):
    """Debian's layout: /usr/bin/nvcc wraps /usr/lib/nvidia-cuda-toolkit/bin/nvcc, the headers are in
    /usr/include: the folder above the PATH entry's (torch's guess) is the toolkit there."""
    real = _fake_toolkit(tmp_path / "lib" / "nvidia-cuda-toolkit")
    (real / "include" / "cuda_runtime.h").unlink()
    usr = tmp_path / "usr"
    _wrapper(usr / "bin", real / "bin" / "nvcc")
    (usr / "include").mkdir()
    (usr / "include" / "cuda_runtime.h").write_text("// fake\n")
    bare_env.setenv("PATH", f"{usr / 'bin'}:/usr/bin:/bin")
    assert _build.cuda_home() == str(usr)


def test_no_nvcc_anywhere_builds_the_cpu_kernels_with_one_warning(bare_env):
    plan = _build.cuda_plan()
    assert not plan.with_cuda and plan.warn
    assert plan.reason.startswith("no CUDA toolkit found (CUDA_HOME unset; no nvcc on PATH; no ")
    assert _build.describe(plan).startswith("pipeoptim_kernels: WARNING: building the CPU kernels only")


def test_a_toolkit_that_cannot_compile_is_found_out_in_seconds(bare_env, tmp_path):
    """The files are there but nvcc fails (here: a fake that fails every compile; in life an unsupported
    target or host compiler): the probe says so before the long build starts."""
    toolkit = _fake_toolkit(tmp_path / "cuda", fail=True)
    bare_env.setenv("PATH", f"{_wrapper(tmp_path / 'wrap', toolkit / 'bin' / 'nvcc').parent}:/usr/bin:/bin")
    plan = _build.cuda_plan()
    assert not plan.with_cuda and plan.warn
    assert "a test compile for TORCH_CUDA_ARCH_LIST=8.0;9.0 failed" in plan.reason
    assert "this fake nvcc fails every compile" in plan.reason


def test_an_nvcc_of_another_cuda_major_than_torch_is_refused(bare_env, tmp_path):
    toolkit = _fake_toolkit(tmp_path / "cuda-12.8", release="12.8")
    bare_env.setenv("CUDA_HOME", str(toolkit))
    plan = _build.cuda_plan()
    assert not plan.with_cuda and plan.warn
    assert "nvcc is CUDA 12.8" in plan.reason and "built with CUDA 13.0" in plan.reason


def test_cpu_only_torch_or_opting_out_is_no_warning(bare_env, tmp_path):
    bare_env.setenv("CUDA_HOME", str(_fake_toolkit(tmp_path / "cuda")))
    bare_env.setenv("PIPEOPTIM_NO_CUDA", "1")
    assert _build.cuda_plan() == _build.CudaPlan(None, "PIPEOPTIM_NO_CUDA=1")
    bare_env.delenv("PIPEOPTIM_NO_CUDA")
    bare_env.setattr(torch.version, "cuda", None)
    plan = _build.cuda_plan()
    assert not plan.with_cuda and not plan.warn and "CPU-only build" in plan.reason
    assert "WARNING" not in _build.describe(plan)


def _real_nvcc():
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.exists(candidate):
            return _build.real_nvcc(candidate)
    pytest.skip("no CUDA toolkit on this machine")


def test_a_wrapper_around_the_real_nvcc_finds_its_toolkit_and_the_probe_passes(bare_env, tmp_path):
    """The lent machines' layout, for real: a wrapper script in another folder that execs the toolkit's nvcc."""
    nvcc = _real_nvcc()
    home = str(Path(nvcc).parent.parent)
    bare_env.setenv("PATH", f"{_wrapper(tmp_path / 'bin', nvcc).parent}:/usr/bin:/bin")
    assert _build.cuda_home() == home and _build.toolkit_problem(home) is None
    bare_env.setattr(torch.version, "cuda", _build.nvcc_release(home))
    bare_env.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert _build.probe_cuda(home) is None
    bare_env.setenv("TORCH_CUDA_ARCH_LIST", "5.0")  # a target torch knows and CUDA 13 dropped
    if int(_build.nvcc_release(home).split(".")[0]) >= 13:
        assert "a test compile for TORCH_CUDA_ARCH_LIST=5.0 failed" in _build.probe_cuda(home)
    bare_env.setenv("TORCH_CUDA_ARCH_LIST", "3.1")  # a target torch does not know: it would stop the build
    assert "TORCH_CUDA_ARCH_LIST=3.1: Unknown CUDA arch (3.1)" in _build.probe_cuda(home)


def test_an_isolated_build_stops_at_once_and_says_how_to_install(tmp_path):
    """pip's build isolation hides the installed torch (simulated here as pip does it: a sitecustomize on
    PYTHONPATH); the build stops in seconds, naming the form that works, instead of fetching another torch."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # as if absent\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "setup.py", "--name"], cwd=_build.ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "pip's build isolation hides" in done.stderr and "pip install --no-build-isolation ." in done.stderr
    assert time.monotonic() - start < 60


# --- A plain install, used from elsewhere ------------------------------------------------------------------

def _copy_of_the_clone(dest: Path) -> Path:
    """The files a clone of this repository has (tracked, plus new ones git does not ignore): no build
    outputs, no extension built here."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=_build.ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout: everything but what a build leaves
        shutil.copytree(_build.ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "runs", "__pycache__", "*.egg-info", "*.so"))
        return dest
    for name in filter(None, listed.stdout.split("\0")):
        if (_build.ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(_build.ROOT / name, dest / name)
    return dest


def test_a_venv_made_from_an_activated_venv_sees_that_venvs_packages(tmp_path):
    """The README's set-up runs the tests inside a venv; the install test below then makes a venv of its own, which
    must see the active venv's packages (torch), not the base interpreter's. Played with a small outer venv that
    holds one module of its own: made from inside it, the inner venv imports that module, and the base
    interpreter's packages stay reachable behind it."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    outer_site = subprocess.run([str(outer / "bin" / "python"), "-c", where], check=True, capture_output=True,
                                text=True).stdout.strip()
    (Path(outer_site) / "only_in_the_outer_venv.py").write_text("WHERE = 'outer'\n")
    inner = tmp_path / "inner"
    make = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import venv_helpers; "
            f"venv_helpers.make_venv_seeing_this_environment(__import__('pathlib').Path({str(inner)!r}))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([str(outer / "bin" / "python"), "-c", make], check=True, env=env)
    seen = subprocess.run([str(inner / "bin" / "python"), "-c",
                           "import only_in_the_outer_venv as m; print(m.WHERE)"],
                          capture_output=True, text=True, env=env)
    assert seen.returncode == 0 and seen.stdout.strip() == "outer", \
        f"a venv made inside a venv does not see that venv's packages: {seen.stderr[-2000:]}"
    # --system-site-packages still reaches the base interpreter's, behind the outer venv's
    paths = subprocess.run([str(inner / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"],
                           check=True, capture_output=True, text=True, env=env).stdout.splitlines()
    base_site = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})["purelib"]
    assert outer_site in paths and base_site in paths, paths
    assert paths.index(outer_site) < paths.index(base_site), paths


@pytest.mark.slow
def test_pip_install_of_a_clone_works_from_outside_the_source_tree(tmp_path):
    """The first way in: a plain `pip install --no-build-isolation <clone>` (not editable) into a venv that
    sees this environment's torch, then the package used from another folder: `pipeoptim --help` and the
    compiled kernels it installed. The CPU kernels alone (a few minutes, not the CUDA build's), through the
    fallback for real: CUDA_HOME names a folder with no toolkit, so the build says so once and goes on."""
    if os.environ.get("PIPEOPTIM_KERNELS_BUILD"):
        pytest.skip("runs in the main pass only (this pass tests the build under PIPEOPTIM_KERNELS_BUILD)")
    clone = _copy_of_the_clone(tmp_path / "clone")
    venv = tmp_path / "venv"
    # pip and setuptools come from this environment, as torch does (no ensurepip: seconds, and an older setuptools);
    # from an activated venv too, whose packages a plain --system-site-packages would not see (venv_helpers)
    make_venv_seeing_this_environment(venv)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PIPEOPTIM_KERNELS_BUILD", "CUDA_PATH", "PIPEOPTIM_NO_CUDA")}
    env.update(CUDA_HOME=str(tmp_path / "no-toolkit-here"), MAX_JOBS="2")
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-v", "--no-build-isolation",
                          "--disable-pip-version-check", str(clone)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    said = pip.stdout + pip.stderr
    assert pip.returncode == 0, said[-5000:]

    warnings = [line for line in said.splitlines() if "pipeoptim_kernels: WARNING" in line]
    if torch.version.cuda is not None:
        assert len(warnings) == 1, warnings
        assert f"CUDA_HOME={tmp_path / 'no-toolkit-here'}, but" in warnings[0]
    else:
        assert not warnings and "building the CPU kernels only (torch" in said
    steps = re.findall(r"^\s*\[(\d+)/(\d+)\]", said, re.MULTILINE)  # ninja: a line per compile step
    assert {total for _, total in steps} == {str(len(_build.CPU_SOURCES))}
    assert sorted(int(done) for done, _ in steps) == list(range(1, len(_build.CPU_SOURCES) + 1))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PIPEOPTIM_NO_JIT"] = "1"  # the installed extension or nothing
    cli = subprocess.run([str(venv / "bin" / "pipeoptim"), "--help"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "train" in cli.stdout, cli.stdout + cli.stderr
    check = ("import pipeoptim, pipeoptim_kernels as pk; from pipeoptim_kernels import compiled; "
             "print(pipeoptim.__file__); print(compiled.load().__file__); print(' '.join(pk.available_backends()))")
    used = subprocess.run([str(venv / "bin" / "python"), "-c", check], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert used.returncode == 0, used.stdout + used.stderr
    package, extension, backends = used.stdout.strip().splitlines()[-3:]
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True,
                               env=env).stdout.strip())
    assert Path(package).is_relative_to(site) and Path(extension).is_relative_to(site)
    assert "cpu" in backends.split()
    # the main job on a user's own text, from the installed package (issue 22's "done when")
    (elsewhere / "notes.txt").write_text(Path(__file__).read_text() * 2)
    trained = subprocess.run([str(venv / "bin" / "pipeoptim"), "train", "--data", "notes.txt", "--steps", "20",
                              "--model", "tiny", "--emulate", "--no-progress", "--run-dir", "run"],
                             cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert trained.stdout.strip().splitlines()[-1].startswith("final loss: ")
    assert (elsewhere / "run" / "history.json").exists() and (elsewhere / "run" / "loss.png").exists()
