"""Pictures: the text grid, the PNG chart (rendered with Agg and checked for content) and the Chrome trace."""
import json

import pytest

from pipeoptim.schedules import get_schedule
from pipeoptim.sim import Costs, simulate
from pipeoptim.viz import chrome_trace, save_comparison_png, save_png, save_trace, text_grid


@pytest.fixture(scope="module")
def bitpipe_result():
    return simulate(get_schedule("bitpipe", 4, 4), Costs(forward=1.0, backward=2.0))


def test_text_grid_has_a_row_per_device_and_the_legend(bitpipe_result):
    lines = text_grid(bitpipe_result).splitlines()
    assert [ln[:4] for ln in lines[1:5]] == ["d0 |", "d1 |", "d2 |", "d3 |"]
    assert lines[1].startswith("d0 |F0>s0 F1>s0 .     F2<s3")
    assert "idle" in lines[-1]


def test_png_shows_devices_idle_time_and_colours(bitpipe_result, tmp_path):
    import matplotlib.image as mpimg
    path = save_png(bitpipe_result, str(tmp_path / "bp.png"))
    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 600
    rgb = img[..., :3].reshape(-1, 3)
    grey = ((abs(rgb - 230 / 255) < 0.01).all(axis=1)).mean()          # the idle background
    colourful = (rgb.max(axis=1) - rgb.min(axis=1) > 0.3).mean()          # micro-batch colours
    assert grey > 0.01 and colourful > 0.05


def test_chrome_trace_has_one_track_per_device_and_every_action(bitpipe_result, tmp_path):
    trace = chrome_trace(bitpipe_result, us_per_unit=1000.0)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(a) for a in bitpipe_result.schedule.actions)
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    first = min((e for e in spans if e["tid"] == 0), key=lambda e: e["ts"])
    assert first["args"] == {"action": "F0>s0", "index": 0, "microbatch": 0, "stage": 0, "replica": 0}
    assert first["dur"] == 500.0                           # a chunk forward: half of one D-th of the model
    path = save_trace(bitpipe_result, str(tmp_path / "t.json"))
    assert json.load(open(path))["otherData"]["bubble_ratio"] == pytest.approx(1 / 7)


def test_comparison_png_draws_each_schedules_numbers(tmp_path, monkeypatch):
    """Every panel has one bar per schedule and ratio whose height is that row's number, in the ratio's colour;
    a schedule its rules exclude gets no bar (height 0); the PNG is written with those colours in it."""
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from pipeoptim.sim import compare
    rows = {r: compare(4, 8, Costs(forward=1.0, backward=r), ["1f1b", "bitpipe", "interleaved"]) for r in (1.0, 2.0)}
    rows[2.0] = rows[2.0] + [{"schedule": "chimera", "error": "excluded"}]
    rows[1.0] = rows[1.0] + [dict(rows[1.0][0], schedule="chimera")]
    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), real_close(fig))[1])
    path = save_comparison_png(rows, str(tmp_path / "c.png"), title="t")
    (fig,) = figures
    names = [r["schedule"] for r in rows[1.0]]
    panels = [("steady_bubble", 0), ("peak_activations", 1), ("weight_versions", 2), ("p2p_bytes_per_device", 3)]
    colours = {}
    for key, i in panels:
        ax = fig.axes[i]
        assert [t.get_text() for t in ax.get_xticklabels()] == names
        bars = ax.patches
        assert len(bars) == 2 * len(names)
        for j, ratio in enumerate(rows):
            by_name = {r["schedule"]: r for r in rows[ratio]}
            for k, name in enumerate(names):
                bar = bars[j * len(names) + k]
                want = 0.0 if "error" in by_name[name] else float(by_name[name][key])
                assert bar.get_height() == pytest.approx(want), (key, ratio, name)
                colours.setdefault(ratio, set()).add(bar.get_facecolor()[:3])
    assert all(len(c) == 1 for c in colours.values()) and colours[1.0] != colours[2.0]
    img = mpimg.imread(path)[..., :3].reshape(-1, 3)
    for (rgb,) in colours.values():
        assert (abs(img - to_rgb(rgb)) < 0.02).all(axis=1).mean() > 0.005, rgb   # each ratio's bars show
