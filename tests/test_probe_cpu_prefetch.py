"""benchmarks/probes/probe_cpu_prefetch.py: its report's every ratio, and the prefetch setting left as it was."""
import importlib.util
from pathlib import Path

import pytest

import pipeoptim_kernels as pk

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("probe_cpu_prefetch",
                                               ROOT / "benchmarks" / "probes" / "probe_cpu_prefetch.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

pytestmark = pytest.mark.skipif("cpu" not in pk.available_backends(), reason="the cpu backend is not built")


def test_a_small_run_reports_every_ratio_and_restores_the_setting(tmp_path, capsys):
    module = pk.compiled.load()
    previous = module.set_cpu_prefetch(512)
    try:
        out = tmp_path / "probe.txt"
        assert probe.main(["--sizes", "4096", "--rounds", "3", "--prefetch", "0,default,128", "--out", str(out)]) == 0
        assert module.cpu_prefetch_bytes() == 512
    finally:
        module.set_cpu_prefetch(previous)
    text = out.read_text()
    assert text.startswith("# python benchmarks/probes/probe_cpu_prefetch.py --sizes 4096")
    for label in ("off", "128 B", f"default ({module.cpu_isa()}:"):
        assert f"  prefetch {label}" in text
    assert text.count("in-place predict's speed / addcmul_'s") == 3
    assert text.count("step+predict / fused Adam step") == 3


def test_the_prefetch_each_variant_runs_with():
    module = pk.compiled.load()
    seen = []
    probe.with_prefetch(256, lambda: seen.append(module.cpu_prefetch_bytes()))()
    probe.with_prefetch(0, lambda: seen.append(module.cpu_prefetch_bytes()))()
    assert seen == [256, 0]


@pytest.mark.parametrize("args, message", [(["--prefetch", "fast"], "--prefetch numbers of bytes"),
                                           (["--prefetch", "-5"], "each --prefetch distance"),
                                           (["--rounds", "2"], "--rounds must be >= 3")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        probe.main(args)
    assert message in capsys.readouterr().err
