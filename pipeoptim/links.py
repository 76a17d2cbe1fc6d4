"""Named network links and the ``--link`` / ``--straggler`` specs: one place for what a link costs.

Why this module exists: whether an asynchronous pipeline pays off depends on the link between stages (issue 43).
The simulator prices a hop as latency + bytes / bandwidth (``sim.Costs``); the runtime can emulate such a link on
real processes (``runtime.comm``, ``pipeoptim train --link``); the time-to-target projection compares schedules
under named links. All three read the constants below, so one link means the same numbers everywhere.

Each profile is a per-hop, one-direction figure for one device pair, with its source. Bandwidths are the
specs' line rates (what a message can reach at best); latencies are end-to-end small-message figures, where no
spec gives one the number is an estimate and says so:

- ``nvlink``: one node of H100 SXM GPUs. NVLink 4 gives each GPU 900 GB/s in both directions together, 450 GB/s
  each way (NVIDIA H100 datasheet; the same figure, "450GB/s theoretical" unidirectional, in NCCL issue #1264,
  where p2pBandwidthLatencyTest measured 376-380 GB/s). Latency 3 us: an estimate of a GPU-to-GPU message's
  end-to-end time (kernel launch and synchronisation included), not a spec figure.
- ``infiniband``: a cluster over InfiniBand NDR, 400 Gb/s per port = 50 GB/s (NVIDIA DGX SuperPOD design guide,
  "NDR Overview": four lanes of 100 Gb/s; ConnectX-7 user manual: single-port NDR 400 Gb/s). Latency 5 us: the
  switch adds < 400 ns port to port (Quantum-2 specification); adapters, PCIe and the software stack make a few
  microseconds end to end, an estimate.
- ``ethernet-10g``: 10 Gb/s Ethernet (IEEE 802.3ae) = 1.25 GB/s; latency 50 us, an estimate of a TCP message
  between two hosts on one switch.
- ``internet``: the decentralized setting, 100 Mbit/s = 12.5 MB/s and 30 ms per hop. SWARM parallelism (Ryabinin
  et al., ICML 2023, arXiv:2301.11913) trained a 1B-parameter Transformer "over a public cloud network with less
  than 200 Mb/s"; issue 43 quotes ~80 Mbit/s for the asynchronous-pipeline paper's swarm (Ajanthan et al., ICML
  2025, arXiv:2505.01099), a figure not checked here. 30 ms is an estimate of one hop between sites on one
  continent (a transatlantic round trip is ~70-80 ms).

Spec syntax (``parse_link``): a profile name, or ``latency=30ms,bandwidth=100Mbit`` (both keys; latency in s,
ms, us or ns; bandwidth in bit/s with k/M/G/T prefixes (``100Mbit``, ``10Gbps``) or in bytes/s (``50GB``,
``12.5MB/s``); SI prefixes, as network specs use). ``parse_straggler`` reads ``STAGE:FACTOR``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Link", "PROFILES", "LinkSpecError", "parse_link", "parse_straggler", "LINK_FORMAT",
           "STRAGGLER_FORMAT"]

LINK_FORMAT = ("a profile name (" + "{names}" + ") or latency=TIME,bandwidth=RATE, e.g. "
               "latency=30ms,bandwidth=100Mbit (TIME in s, ms, us or ns; RATE in bit/s as 100Mbit, 10Gbps, or in "
               "bytes/s as 50GB, 12.5MB/s)")
STRAGGLER_FORMAT = "STAGE:FACTOR, e.g. 1:1.5 (pipeline device 1 computes 1.5x slower; FACTOR >= 1)"


class LinkSpecError(ValueError):
    """A ``--link`` or ``--straggler`` spec that cannot be read; the message names the format."""


@dataclass(frozen=True)
class Link:
    """One hop: a message of b bytes takes ``latency_s + b / bandwidth_Bps`` seconds."""
    latency_s: float
    bandwidth_Bps: float
    name: str = ""
    source: str = ""

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    def describe(self) -> str:
        """The link in the spec syntax, with its profile name if it has one (what outputs print)."""
        spec = f"latency={_time_words(self.latency_s)},bandwidth={_rate_words(self.bandwidth_Bps)}"
        return f"{self.name} ({spec})" if self.name else spec


PROFILES: dict[str, Link] = {
    "nvlink": Link(3e-6, 450e9, "nvlink", "NVLink 4, H100 SXM: 450 GB/s each way (NVIDIA H100 datasheet); "
                                         "latency an estimate"),
    "infiniband": Link(5e-6, 50e9, "infiniband", "InfiniBand NDR 400 Gb/s per port (NVIDIA DGX SuperPOD design "
                                                  "guide); latency an estimate"),
    "ethernet-10g": Link(50e-6, 1.25e9, "ethernet-10g", "10 Gb/s Ethernet (IEEE 802.3ae); latency an estimate"),
    "internet": Link(30e-3, 12.5e6, "internet", "100 Mbit/s, 30 ms per hop: SWARM (arXiv:2301.11913) < 200 Mb/s; "
                                                "latency an estimate"),
}

_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _bad(spec: str, problem: str) -> LinkSpecError:
    return LinkSpecError(f"--link {spec!r}: {problem}; give "
                         + LINK_FORMAT.replace("{names}", ", ".join(PROFILES)))


def _time(spec: str, text: str) -> float:
    m = re.fullmatch(_NUMBER + r"\s*(s|ms|us|µs|ns)", text.strip())
    if not m:
        raise _bad(spec, f"latency {text!r} is not a time with a unit")
    return float(m.group(1)) * _TIME[m.group(2)]


def _rate(spec: str, text: str) -> float:
    """Bytes per second."""
    t = text.strip()
    m = re.fullmatch(_NUMBER + r"\s*([kKMGT]?)(bit|bps|b)(?:/s|ps)?", t)
    if m:
        return float(m.group(1)) * _PREFIX[m.group(2)] / 8.0
    m = re.fullmatch(_NUMBER + r"\s*([kKMGT]?)B(?:/s|ps)?", t)
    if m:
        return float(m.group(1)) * _PREFIX[m.group(2)]
    raise _bad(spec, f"bandwidth {text!r} is not a rate with a unit (bits: 100Mbit, 10Gbps; bytes: 50GB, 12.5MB/s)")


def parse_link(spec: str) -> Link:
    """A profile by name, or ``latency=...,bandwidth=...`` (module docstring); refuses anything else."""
    text = spec.strip()
    if text in PROFILES:
        return PROFILES[text]
    parts = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in ("latency", "bandwidth"):
            raise _bad(spec, f"{item!r} is neither latency=TIME nor bandwidth=RATE")
        if key.strip() in parts:
            raise _bad(spec, f"{key.strip()} is given twice")
        parts[key.strip()] = value
    missing = [k for k in ("latency", "bandwidth") if k not in parts]
    if missing:
        raise _bad(spec, f"{' and '.join(missing)} missing")
    latency, bandwidth = _time(spec, parts["latency"]), _rate(spec, parts["bandwidth"])
    if not (math.isfinite(latency) and latency >= 0):
        raise _bad(spec, "the latency must be a finite time >= 0")
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise _bad(spec, "the bandwidth must be a finite rate > 0")
    return Link(latency, bandwidth)


def parse_straggler(spec: str, devices: int | None = None) -> tuple[int, float]:
    """``STAGE:FACTOR`` -> (pipeline device, factor >= 1); ``devices`` bounds the device when given."""
    m = re.fullmatch(r"\s*([0-9]+)\s*:\s*" + _NUMBER + r"\s*", spec)
    if not m:
        raise LinkSpecError(f"--straggler {spec!r}: give {STRAGGLER_FORMAT}")
    stage, factor = int(m.group(1)), float(m.group(2))
    if factor < 1.0:
        raise LinkSpecError(f"--straggler {spec!r}: the factor must be >= 1 (a slower device), got {factor:g}; "
                            f"give {STRAGGLER_FORMAT}")
    if devices is not None and stage >= devices:
        raise LinkSpecError(f"--straggler {spec!r}: the pipeline has devices 0..{devices - 1}; give one of them "
                            f"({STRAGGLER_FORMAT})")
    return stage, factor


def _time_words(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds / 1e-9:g}ns"


def _rate_words(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8.0
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{prefix}bit/s"
    return f"{bits:g}bit/s"
