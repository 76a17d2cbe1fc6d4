"""pipeoptim.links: the named link profiles and the --link / --straggler specs (parsing, units, refusals), the
flags of `pipeoptim train` that carry them (refused before anything runs, labelled as emulation in the config),
and the worker's straggler delay."""
from __future__ import annotations

import argparse
import time

import pytest

from pipeoptim.links import PROFILES, Link, LinkSpecError, parse_link, parse_straggler


def test_profiles_carry_their_spec_numbers_and_a_source():
    assert PROFILES["nvlink"].bandwidth_Bps == 450e9          # NVLink 4: 900 GB/s both ways, 450 each way
    assert PROFILES["infiniband"].bandwidth_Bps == 400e9 / 8  # NDR 400 Gb/s
    assert PROFILES["ethernet-10g"].bandwidth_Bps == 10e9 / 8
    assert (PROFILES["internet"].latency_s, PROFILES["internet"].bandwidth_Bps) == (30e-3, 100e6 / 8)
    assert all(p.source for p in PROFILES.values())
    # slower profiles are slower for any message
    order = ["nvlink", "infiniband", "ethernet-10g", "internet"]
    for nbytes in (0, 131072, 1e9):
        times = [PROFILES[n].transfer_s(nbytes) for n in order]
        assert times == sorted(times)


@pytest.mark.parametrize("spec, latency, bandwidth", [
    ("latency=30ms,bandwidth=100Mbit", 0.03, 12.5e6),
    ("bandwidth=10Gbps, latency=5us", 5e-6, 1.25e9),
    ("latency=1.5s,bandwidth=12.5MB/s", 1.5, 12.5e6),
    ("latency=0ns,bandwidth=50GB", 0.0, 50e9),
    ("latency=2e-3s,bandwidth=8kbit/s", 2e-3, 1e3),
])
def test_a_spec_is_read_with_its_units(spec, latency, bandwidth):
    link = parse_link(spec)
    assert link.latency_s == pytest.approx(latency) and link.bandwidth_Bps == pytest.approx(bandwidth)
    assert link.transfer_s(1000) == pytest.approx(latency + 1000 / bandwidth)
    assert parse_link(link.describe()) == link          # what outputs print reads back as the same link


def test_a_profile_name_is_its_link():
    assert parse_link("internet") is PROFILES["internet"]
    assert parse_link("internet").describe() == "internet (latency=30ms,bandwidth=100Mbit/s)"


@pytest.mark.parametrize("spec, problem", [
    ("latency=30,bandwidth=100Mbit", "is not a time with a unit"),
    ("latency=30ms,bandwidth=100", "is not a rate with a unit"),
    ("latency=30ms", "bandwidth missing"),
    ("latency=30ms,bandwidth=1Mbit,latency=1ms", "given twice"),
    ("lan", "neither latency=TIME nor bandwidth=RATE"),
    ("latency=30ms,bandwidth=0Mbit", "must be a finite rate > 0"),
])
def test_a_bad_spec_is_refused_naming_the_format(spec, problem):
    with pytest.raises(LinkSpecError) as e:
        parse_link(spec)
    assert problem in str(e.value) and "latency=TIME,bandwidth=RATE" in str(e.value) and "internet" in str(e.value)


def test_straggler_spec():
    assert parse_straggler("1:1.5") == (1, 1.5)
    assert parse_straggler(" 3 : 2 ", devices=4) == (3, 2.0)
    for bad, problem in (("1", "STAGE:FACTOR"), ("a:2", "STAGE:FACTOR"), ("1:0.5", "must be >= 1"),
                         ("4:2", "devices 0..3")):
        with pytest.raises(LinkSpecError, match=problem.replace(".", r"\.")):
            parse_straggler(bad, devices=4)


def test_train_flags_refuse_bad_specs_and_label_the_emulation():
    from pipeoptim.cli import build_parser
    from pipeoptim.cli.train import _config
    from pipeoptim.runtime.plan import ConfigError

    parser = build_parser()
    parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(argparse.ArgumentError(None, message))
    parser.error = lambda message: (_ for _ in ()).throw(argparse.ArgumentError(None, message))
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(["train", "--link", "latency=30"])
    cfg = _config(build_parser().parse_args(["train", "--model", "tiny", "--stages", "2", "--link", "internet",
                                             "--straggler", "1:1.5"]))
    assert cfg.emulation == ("emulated: link internet (latency=30ms,bandwidth=100Mbit/s); "
                                "straggler device 1 x1.5")
    assert _config(build_parser().parse_args(["train", "--model", "tiny", "--stages", "2"])).emulation == ""
    with pytest.raises(ConfigError, match="devices 0..1"):
        _config(build_parser().parse_args(["train", "--model", "tiny", "--stages", "2", "--straggler", "2:2"]))
    with pytest.raises(ConfigError, match="Drop --emulate"):
        _config(build_parser().parse_args(["train", "--model", "tiny", "--emulate", "--link", "internet"]))


def test_a_straggler_sleeps_factor_minus_one_times_its_op():
    from pipeoptim.runtime.worker import DeviceWorker

    worker = DeviceWorker.__new__(DeviceWorker)
    worker.slowdown = 3.0
    t0 = time.perf_counter()
    time.sleep(0.02)                       # the op
    worker._straggle(t0)
    assert time.perf_counter() - t0 >= 3.0 * 0.02 - 1e-3
    worker.slowdown = 1.0
    t0 = time.perf_counter()
    worker._straggle(t0 - 10.0)            # an op of 10 s: no delay without a straggler
    assert time.perf_counter() - t0 < 0.5


def test_link_is_refused_across_machines_under_torchrun(monkeypatch):
    from pipeoptim.cli import build_parser
    from pipeoptim.cli.train import _config
    from pipeoptim.runtime.plan import ConfigError

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.delenv("PIPEOPTIM_LAUNCHED", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    args = build_parser().parse_args(["train", "--model", "tiny", "--stages", "2", "--link", "internet"])
    with pytest.raises(ConfigError, match="only one machine"):
        _config(args)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")   # both ranks on this node: allowed
    assert _config(args).emulation.startswith("emulated: link internet")


def test_link_is_refused_on_gpus_before_anything_starts():
    from pipeoptim.cli import build_parser
    from pipeoptim.cli.train import _config
    from pipeoptim.runtime.plan import ConfigError

    with pytest.raises(ConfigError, match="Use --device cpu with --link"):
        _config(build_parser().parse_args(["train", "--model", "tiny", "--stages", "2", "--device", "cuda",
                                           "--link", "internet"]))


def test_pipeline_refuses_a_link_it_cannot_emulate():
    import torch

    from pipeoptim.runtime.plan import ConfigError
    from pipeoptim.train import Pipeline

    kw = dict(loss_fn=lambda y, t: ((y - t) ** 2).mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=2)
    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.raises(ConfigError, match="Use device='cpu' with link="):
        Pipeline(layers, link=PROFILES["internet"], device="cuda", **kw)
    with pytest.raises(ConfigError, match="Drop emulate=True"):
        Pipeline(layers, emulate=True, straggler=(1, 2.0), **kw)
