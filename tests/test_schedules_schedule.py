"""Schedule as data: text form round trip (generated and hand-written), CSV export, placement checks."""
import pytest

from pipeoptim.schedules import SCHEDULES, Chunk, Forward, Schedule, Step, get_schedule, lower


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_generated_schedule_round_trips_through_text(name):
    s = get_schedule(name, devices=4, microbatches=8)
    text = s.to_text()
    back = Schedule.from_text(text)
    assert back == s
    assert back.to_text() == text
    assert back.params == s.params


def test_lowered_schedule_round_trips_through_text():
    s = lower(get_schedule("bitpipe", devices=2, microbatches=4))
    assert Schedule.from_text(s.to_text()) == s


def test_text_form_reads_like_the_docs():
    s = get_schedule("1f1b", devices=2, microbatches=3)
    assert s.to_text() == (
        "schedule 1f1b devices=2 microbatches=3 stages=2 synchronous=true\n"
        "d0 chunks: s0\n"
        "d1 chunks: s1\n"
        "d0: F0s0 F1s0 B0s0 F2s0 B1s0 B2s0 STEP:s0\n"
        "d1: F0s1 B0s1 F1s1 B1s1 F2s1 B2s1 STEP:s1\n")


def test_hand_written_text_with_comments_parses():
    text = """# a tiny GPipe by hand
    schedule mine devices=1 microbatches=2 stages=1 synchronous=true note=hello
    d0 chunks: s0
    d0: F0s0 F1s0 B0s0 B1s0 STEP:s0
    """
    s = Schedule.from_text(text)
    assert s.actions[0][0] == Forward(0, 0) and s.actions[0][-1] == Step(0)
    assert s.params == {"note": "hello"}


@pytest.mark.parametrize("text,match", [
    ("d0: F0s0", "must start with"),
    ("schedule x devices=1 stages=1 synchronous=true\nd0 chunks: s0\nd0: F0s0", "microbatches"),
    ("schedule x devices=1 microbatches=1 stages=1 synchronous=true\nd0 chunks: s0", "no actions line"),
    ("schedule x devices=1 microbatches=1 stages=1 synchronous=true\nd0 chunks: s0\nd3: F0s0", "device 3"),
    ("schedule x devices=1 microbatches=1 stages=1 synchronous=true\nd0 chunks: q0\nd0: F0s0", "cannot read chunk"),
])
def test_bad_text_says_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_text(text)


def test_csv_export_has_one_row_per_device_and_reads_back():
    s = get_schedule("chimera", devices=4, microbatches=4)
    rows = s.to_csv().splitlines()
    assert len(rows) == 4 and rows[0].startswith("d0,F0>s0,")
    assert Schedule.actions_from_csv(s.to_csv()) == [list(a) for a in s.actions]


def test_placement_must_give_each_chunk_one_device_and_cover_all_stages():
    with pytest.raises(ValueError, match="exactly one device"):
        Schedule("x", 2, 1, 2, [[Chunk(0, 0)], [Chunk(0, 0)]], [[], []])
    with pytest.raises(ValueError, match="no device for stages"):
        Schedule("x", 2, 1, 3, [[Chunk(0, 0)], [Chunk(0, 1)]], [[], []])
    with pytest.raises(ValueError, match="2 devices"):
        Schedule("x", 2, 1, 1, [[Chunk(0, 0)]], [[]])


def test_derived_views():
    s = get_schedule("bitpipe", devices=4, microbatches=8)
    assert s.num_replicas == 2 and s.directed
    assert s.device_of(7, 0) == 0 and s.device_of(4, 1) == 0
    assert [s.microbatch_replica[m] for m in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
