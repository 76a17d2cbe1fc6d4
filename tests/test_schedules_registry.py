"""Schedules by name; every rule violation says the rule and a valid alternative."""
import pytest

from pipeoptim.schedules import INFO, SCHEDULES, ScheduleConfigError, get_schedule, validate


def test_all_names_are_registered():
    assert SCHEDULES == ["gpipe", "1f1b", "interleaved", "chimera", "bitpipe", "zb-h1", "zbv", "dualpipev",
                         "async-1f1b", "async-zb", "2bw"]
    assert [n for n in SCHEDULES if not INFO[n].synchronous] == ["async-1f1b", "async-zb", "2bw"]


@pytest.mark.parametrize("name,kwargs,message", [
    ("bitpipe", dict(devices=3, microbatches=6),
     "bitpipe needs an even number of devices (got 3); use --devices 4 or the 1f1b schedule"),
    ("bitpipe", dict(devices=4, microbatches=6),
     "multiple of the number of devices (got 6 micro-batches on 4 devices); use --microbatches 4 or 8"),
    ("interleaved", dict(devices=4, microbatches=2), "use --microbatches 4, or the 1f1b schedule"),
    ("chimera", dict(devices=5, microbatches=4), "chimera needs an even number of devices (got 5); use --devices 6"),
    ("chimera", dict(devices=4, microbatches=3), "even number of micro-batches"),
    ("2bw", dict(devices=4, microbatches=8, update_every=2), "use --update-every 4"),
    ("2bw", dict(devices=4, microbatches=6), "use --microbatches 4 or 8"),
    ("1f1b", dict(devices=4, microbatches=4, chunks=2), "interleaved schedule only"),
    ("1f1b", dict(devices=0, microbatches=4), "positive integer"),
    ("1f1b", dict(devices=4, microbatches=4, concat="paced"), "chimera and bitpipe schedules only"),
    ("dualpipev", dict(devices=4, microbatches=7), "dualpipev needs at least twice as many micro-batches as "
     "devices, one per stage of its V (got 7 micro-batches on 4 devices); use --microbatches 8, or the zbv"),
    ("zb", dict(devices=4, microbatches=4), "unknown schedule 'zb'; choose one of gpipe, 1f1b"),
])
def test_rules_give_clear_errors(name, kwargs, message):
    with pytest.raises(ScheduleConfigError) as e:
        get_schedule(name, **kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "async-1f1b", "chimera"])
def test_fewer_microbatches_than_devices_where_allowed(name):
    s = get_schedule(name, devices=8, microbatches=2)
    validate(s)
    assert s.num_microbatches == 2


@pytest.mark.parametrize("name", SCHEDULES)
def test_pp2_works_for_every_schedule(name):
    validate(get_schedule(name, devices=2, microbatches=4))


def test_data_parallel_adds_syncs_where_each_kind_of_schedule_needs_them():
    from pipeoptim.schedules import Backward, Step, Sync
    one = get_schedule("1f1b", 2, 2, data_parallel=True)
    assert [str(a) for a in one.actions[0]][-2:] == ["SYNC:s0@:dp", "STEP:s0"]
    il = get_schedule("interleaved", 2, 4, data_parallel=True)
    for d, acts in enumerate(il.actions):          # eager: right after each chunk's last backward
        for i, a in enumerate(acts):
            if isinstance(a, Sync):
                assert isinstance(acts[i - 1], Backward) and acts[i - 1].stage == a.stages[0]
                assert not any(isinstance(b, Backward) and b.stage == a.stages[0] for b in acts[i:])
    bp = get_schedule("bitpipe", 4, 4, data_parallel=True)
    assert all(a.dp and len(a.devices) == 2 for acts in bp.actions for a in acts if isinstance(a, Sync))
    asy = get_schedule("async-1f1b", 2, 3, data_parallel=True)
    for acts in asy.actions:
        steps = [i for i, a in enumerate(acts) if isinstance(a, Step)]
        assert steps and all(acts[i - 1] == Sync((acts[i].stage,), (), dp=True) for i in steps)
    for s in (one, il, bp, asy):
        validate(s)
