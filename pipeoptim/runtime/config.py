"""Turn names (schedule, policy, micro-batches, stages) into a checked configuration, before any process starts.

Every rule a run can break is checked here, in the launching process, so a wrong configuration fails in a
second with the rule and a fix instead of after spawning workers (or as a hang inside them). Schedules are
built by name through the schedules package's registry when it offers one, else from its generator modules.
"""
from __future__ import annotations

from typing import Callable

from ..schedules.schedule import Schedule
from ..errors import ConfigError

__all__ = ["SCHEDULES", "ASYNC_POLICIES", "make_schedule", "check_policy", "schedule_names", "stages_for"]

ASYNC_POLICIES = ("pipeoptim", "none", "stash", "2bw", "spectrain")


def _generators() -> dict[str, Callable[..., Schedule]]:
    from ..schedules import asynchronous, bidirectional, synchronous, zero_bubble
    return {
        "gpipe": synchronous.gpipe,
        "1f1b": synchronous.one_f_one_b,
        "interleaved": synchronous.interleaved,
        "chimera": bidirectional.chimera,
        "bitpipe": bidirectional.bitpipe,
        "zb-h1": zero_bubble.zb_h1,
        "zbv": zero_bubble.zbv,
        "dualpipev": zero_bubble.dualpipev,
        "async-1f1b": asynchronous.async_1f1b,
        "async-zb": asynchronous.async_zb,
        "2bw": asynchronous.two_bw,
    }


SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera", "bitpipe", "zb-h1", "zbv", "dualpipev", "async-1f1b",
             "async-zb", "2bw")
_ALIASES = {"pipedream": "async-1f1b", "async": "async-1f1b", "async1f1b": "async-1f1b", "dapple": "1f1b"}


def schedule_names() -> tuple[str, ...]:
    return SCHEDULES


def stages_for(name: str, devices: int, chunks: int = 2) -> int:
    """Stages per model replica that schedule ``name`` cuts the model into on ``devices`` devices."""
    name = _ALIASES.get(name, name)
    if name == "interleaved":
        return devices * chunks
    if name in ("bitpipe", "zbv", "dualpipev"):
        return 2 * devices
    return devices


def _rules(name: str, D: int, N: int, params: dict) -> None:
    if D < 1:
        raise ConfigError(f"a pipeline needs at least 1 device, got {D}")
    if N < 1:
        raise ConfigError(f"a pipeline needs at least 1 micro-batch, got {N}")
    if name in ("chimera", "bitpipe") and (D % 2 or D < 2):
        raise ConfigError(f"{name} needs an even number of devices >= 2 (rank r pairs with mirror D-1-r), got "
                          f"{D}: use {D + 1 if D % 2 else 2} devices, or schedule '1f1b'")
    if name in ("chimera", "bitpipe") and N % D:
        raise ConfigError(f"{name} needs micro-batches to be a multiple of the devices (groups of D, half each "
                          f"way), got N={N}, D={D}: use N={max(D, (N // D) * D)} or {(N // D + 1) * D}")
    if name == "interleaved" and N % D:
        raise ConfigError(f"interleaved 1F1B needs micro-batches to be a multiple of the devices, got N={N}, "
                          f"D={D}: use N={(N // D + 1) * D}")
    if name == "dualpipev" and N < 2 * D:
        raise ConfigError(f"dualpipev needs at least 2 x devices micro-batches (one per stage of its V), got N={N}, "
                          f"D={D}: use N={2 * D}, or schedule 'zbv'")
    if name == "2bw":
        m = params.get("update_every", D)
        if m < D:
            raise ConfigError(f"2bw with update_every={m} < D={D} would need a third weight version; use "
                              f"update_every >= {D}")
        if N % m:
            raise ConfigError(f"2bw steps every update_every={m} micro-batches, so micro-batches must be a "
                              f"multiple of it, got N={N}: use N={(N // m + 1) * m}")


def make_schedule(name: str, devices: int, microbatches: int, **params) -> Schedule:
    """The schedule called ``name`` for ``devices`` pipeline ranks and ``microbatches`` micro-batches."""
    key = _ALIASES.get(name, name)
    gens = _generators()
    if key not in gens:
        raise ConfigError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    _rules(key, devices, microbatches, params)
    try:
        from ..schedules.registry import get_schedule
    except ImportError:  # older schedules package without a registry
        get_schedule = None
    try:
        if get_schedule is not None:
            return get_schedule(key, devices, microbatches, **params)
        return gens[key](devices, microbatches, **params)
    except TypeError as e:
        raise ConfigError(f"schedule {key!r} does not take parameters {sorted(params)}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"schedule {key!r} with D={devices}, N={microbatches}: {e}") from None


def check_policy(schedule: Schedule, policy: str | None) -> str:
    """The weight policy to run: synchronous schedules use 'none' (one version); async ones need a name."""
    if policy is None:
        policy = "none" if schedule.synchronous else ("2bw" if schedule.name == "2bw" else "pipeoptim")
    if policy not in ASYNC_POLICIES:  # a registered one, maybe: only then load the registry (and torch)
        from ..policies import POLICIES
        if policy not in POLICIES:
            raise ConfigError(f"unknown weight policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if schedule.synchronous and policy != "none":
        raise ConfigError(f"schedule {schedule.name!r} is synchronous (every micro-batch sees the same weights), "
                          f"so weight policy {policy!r} has nothing to do; use policy 'none' or an asynchronous "
                          "schedule ('async-1f1b', 'async-zb', '2bw')")
    if policy == "2bw" and schedule.name != "2bw":
        raise ConfigError("policy '2bw' accumulates gradients over several micro-batches and needs the '2bw' "
                          "schedule (which steps every update_every backwards); use schedule '2bw'")
    in_flight = schedule.params.get("in_flight", 1)
    if policy == "2bw" and in_flight > 1:
        from ..schedules.staleness import max_version_difference
        s = max(max_version_difference(schedule).values())
        if s > 1:
            raise ConfigError(f"policy '2bw' keeps two weight versions, enough for one update between a micro-batch's "
                              f"forward and its backward; with in_flight={in_flight} the schedule has up to {s}. "
                              "Use policy 'stash' (a version per micro-batch in flight) or 'pipeoptim' (predicted "
                              "weights), or in_flight=1")
    return policy
