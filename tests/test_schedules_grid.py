"""The device x time text grid: widths follow durations, idle is visible, invalid steps are marked."""
from pipeoptim.schedules import Backward, Chunk, Forward, Schedule, get_schedule
from pipeoptim.schedules.grid import format_grid, format_order_grid
from pipeoptim.schedules.timeline import run_timeline, unit_durations


def test_grid_rows_show_time_and_idle():
    grid = format_grid(run_timeline(get_schedule("1f1b", 2, 2), unit_durations(2.0)), legend=False)
    lines = grid.splitlines()
    assert "1 column = 1 time units" in lines[0]
    assert lines[1].startswith("d0 |F0 F1 .  .  B0=== .  B1===")  # d0 idles while d1 runs F0 B0
    assert lines[2].startswith("d1 |.  F0 B0=== F1 B1===")
    assert lines[1].rstrip().endswith("|")                           # the optimizer step marker


def test_stuck_actions_are_marked_and_explained():
    chunks = [[Chunk(0, 0)], [Chunk(0, 1)]]
    acts = [[Forward(0, 0), Backward(0, 0)], [Backward(0, 1), Forward(0, 1)]]
    grid = format_grid(run_timeline(Schedule("x", 2, 1, 2, chunks, acts)))
    assert "!B0" in grid
    assert "! device 1, action 0 (B0s1) waits for F0s1 on device 1" in grid


def test_order_grid_marks_a_position():
    s = get_schedule("gpipe", 2, 2)
    grid = format_order_grid(s, marks=[(1, 2)], notes=["! here"])
    row = grid.splitlines()[2]
    assert row.split()[3] == "!B0"
    assert "not time" in grid and "! here" in grid
