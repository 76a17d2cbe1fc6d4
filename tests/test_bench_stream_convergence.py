"""benchmarks/bench_stream_convergence.py: windows against a stream of the same runs, and its report."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_stream_convergence as bench  # noqa: E402


def test_both_modes_run_and_a_rerun_resumes_from_the_csv(tmp_path, capsys):
    out = tmp_path / "runs.csv"

    def args(windows):
        return ["--configs", "main", "--seeds", "0", "--lrs", "3e-3", "--windows", str(windows), "--csv", str(out)]
    bench.main(args(3))
    rows = bench.read_rows(str(out))
    assert [(r["mode"], r["windows"], r["finished"]) for r in rows] == [("windows", 3, True), ("stream", 3, True)]
    assert out.read_text().startswith("# python benchmarks/bench_stream_convergence.py --configs main")
    windows, stream = rows
    for r in rows:
        assert 0 < r["val_loss"] < 6 and 0 < r["tail_loss"] < 6  # bytes: the first losses are near ln 256 = 5.5
    # the stream carries micro-batches in flight from one call to the next, so the runs part after the first call
    assert windows["val_loss"] != stream["val_loss"]
    printed = capsys.readouterr().out
    assert "2 runs to do" in printed and "| 0.003 |" in printed

    bench.main(args(3))  # everything is in the CSV: nothing runs again
    assert "0 runs to do (2 in" in capsys.readouterr().out
    assert len(bench.read_rows(str(out))) == 2
    bench.main(args(2))  # another invocation adds its rows under its own command
    lines = out.read_text().splitlines()
    assert [line.split(" --windows ")[1].split()[0] for line in lines if line.startswith("# python")] == ["3", "2"]
    assert len(bench.read_rows(str(out))) == 4


def test_stream_flag_and_end_only_evaluation_reach_pipeoptim_train():
    windows = bench.train_args("2bw-n", "windows", 3e-3, 1, 200, "run")
    stream = bench.train_args("2bw-n", "stream", 3e-3, 1, 200, "run")
    assert stream == windows + ["--stream"]
    joined = " ".join(windows)
    # evaluation and checkpoints drain a stream, so both modes do them only at the end
    assert "--eval-every 0 --save-every 0" in joined and "--update-every 8" in joined and "--seed 1" in joined


def _row(mode, lr, seed, val, finished=True):
    return dict(config="main", mode=mode, lr=lr, seed=seed, windows=200, val_loss=val, tail_loss=val + 0.1,
                finished=finished)


def test_each_mode_gets_its_own_best_lr_and_an_edge_is_said_to_be_unbracketed():
    rows = [_row("windows", lr, s, v + 0.01 * s) for lr, v in ((1e-3, 2.3), (2e-3, 2.1), (4e-3, 2.2)) for s in (0, 1)]
    rows += [_row("stream", lr, s, v) for lr, v in ((1e-3, 2.0), (2e-3, 2.1), (4e-3, 2.2)) for s in (0, 1)]
    assert bench.best_lr(rows, "main", "windows", [0, 1]) == (2e-3, True)
    assert bench.best_lr(rows, "main", "stream", [0, 1]) == (1e-3, False)
    # a run that did not finish counts as the worst, never as the best
    rows.append(_row("stream", 5e-4, 0, 1.0, finished=False))
    rows.append(_row("stream", 5e-4, 1, 1.0))
    assert bench.best_lr(rows, "main", "stream", [0, 1]) == (1e-3, True)
    text = bench.report(rows, ["main"], [0, 1])
    assert "windows: 0.002; stream: 0.001." in text
    # at the modes' best: stream (2.0, 2.0) against windows (2.1, 2.11), per seed
    assert "stream − windows per seed -0.1000, -0.1100 (mean -0.1050; the stream lower in 2 of 2)" in text
    # the unfinished run shows as nan, not as its number, and leaves no mean
    assert "| 0.0005 | nan, nan (n/a) | nan, 1.0000 (n/a) |" in text


def test_a_run_that_writes_no_history_is_an_error_with_its_output(monkeypatch):
    monkeypatch.setitem(bench.CONFIGS, "broken", (("--model", "no-such-model"), (1e-3,)))
    with pytest.raises(RuntimeError, match="wrote no history") as e:
        bench.run_one("broken", "windows", 1e-3, 0, 2)
    assert "no-such-model" in str(e.value)


def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "runs.csv"
    for bad, said in ((["--lrs", "1e-3", "0"], "--lrs must be positive"), (["--windows", "0"], "at least 1"),
                      (["--configs", "nope"], "invalid choice")):
        with pytest.raises(SystemExit):
            bench.main(bad + ["--csv", str(out)])
        assert said in capsys.readouterr().err
    assert not out.exists()
