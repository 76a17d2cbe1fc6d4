"""The pipeoptim command: ``schedule`` prints the grid and ends with the bubble ratio, writes pictures, reports
rule violations as errors; ``compare-schedules`` tabulates; subcommands register without heavy imports."""
import json
import subprocess
import sys

import pytest

from pipeoptim.cli import COMMANDS, build_parser, format_table, main, register


def test_schedule_prints_grid_and_ends_with_bubble_ratio(capsys):
    assert main(["schedule", "1f1b", "--devices", "4", "--microbatches", "8", "--bwd-ratio", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("d0 |F0 F1 F2 F3")
    assert out[-1] == f"bubble ratio: {3 / 11:.6f}"


def test_schedule_writes_png_trace_text_and_csv(tmp_path, capsys):
    png, trace, text, csv = (str(tmp_path / n) for n in ("s.png", "s.json", "s.txt", "s.csv"))
    assert main(["schedule", "bitpipe", "-D", "4", "-N", "4", "--png", png, "--trace", trace, "--text", text,
                 "--csv", csv, "--no-grid"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"bubble ratio: {1 / 7:.6f}" and "d0 |" not in out
    assert open(png, "rb").read(4) == b"\x89PNG"
    assert json.load(open(trace))["traceEvents"]
    assert open(text).read().startswith("schedule bitpipe devices=4")
    assert open(csv).read().startswith("d0,F0>s0,F1>s0,F2<s3")


def test_bitpipe_concatenations_from_the_command_line(capsys):
    bubbles = {}
    for concat in ("reference", "greedy", "paced"):
        assert main(["schedule", "bitpipe", "-D", "4", "-N", "16", "--concat", concat, "--no-grid"]) == 0
        bubbles[concat] = float(capsys.readouterr().out.splitlines()[-1].split(": ")[1])
    assert bubbles["reference"] > bubbles["greedy"] > bubbles["paced"]       # 0.0943 > 0.0857 > 0.0495
    assert main(["schedule", "chimera", "-D", "4", "-N", "4", "--concat", "greedy"]) == 2
    assert "chimera has no concatenation 'greedy'" in capsys.readouterr().err


def test_rule_violation_is_an_error_message_not_a_traceback(capsys):
    assert main(["schedule", "bitpipe", "--devices", "3", "--microbatches", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bitpipe needs an even number of devices (got 3); use --devices 4 or the 1f1b")


def test_compare_schedules_table_csv_and_plot(tmp_path, capsys):
    csv, png = str(tmp_path / "c.csv"), str(tmp_path / "c.png")
    assert main(["compare-schedules", "-D", "4", "-N", "6", "--bwd-ratio", "2", "--csv", csv, "--png", png]) == 0
    out = capsys.readouterr().out
    assert "1f1b" in out and "bitpipe[reference]: bitpipe needs the number of micro-batches" in out
    assert open(csv).read().splitlines()[0].startswith("bwd_ratio,schedule,bubble_ratio")
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_format_table_aligns_columns():
    rows = [{"schedule": "a", "bubble_ratio": 0.5, "steady_bubble": 0.5, "makespan": 3.0, "peak_activations": 1.0,
             "weight_copies": 1.0, "weight_versions": 1.0, "p2p_bytes_per_device": 2.0,
             "allreduce_bytes_total": 0.0}]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["schedule", "bubble", "steady"] and lines[2].split()[1] == "0.5000"


def test_subcommands_register_and_duplicates_are_refused():
    seen = []
    register("probe-test", "probe", lambda p: p.add_argument("--x", type=int), lambda a: seen.append(a.x) or 0)
    try:
        assert main(["probe-test", "--x", "3"]) == 0 and seen == [3]
        with pytest.raises(ValueError, match="already registered"):
            register("probe-test", "again", lambda p: None, lambda a: 0)
    finally:
        COMMANDS.pop("probe-test")
    assert set(build_parser()._subparsers._group_actions[0].choices) >= {"schedule", "compare-schedules"}


def test_schedule_command_does_not_import_torch_distributed():
    code = ("import sys; from pipeoptim.cli import main; main(['schedule', 'gpipe', '-D', '2', '-N', '2']); "
            "print('torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"


def test_module_runs_as_a_script():
    out = subprocess.run([sys.executable, "-m", "pipeoptim.cli", "schedule", "2bw", "-D", "2", "-N", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].startswith("bubble ratio: ")


def test_split_schedules_take_the_weight_share(tmp_path, capsys):
    """ZB-H1 with I = 1.2 and W = 0.8 (B = 2F, W share 0.4): each device idles (D-1)(F + I - W) = 4.2."""
    text = str(tmp_path / "zb.txt")
    assert main(["schedule", "zb-h1", "-D", "4", "-N", "8", "--weight-share", "0.4", "--text", text]) == 0
    out = capsys.readouterr().out.splitlines()
    d3 = next(line for line in out if line.startswith("d3 |"))
    assert "F0-" in d3 and "I0=" in d3 and "W0+" in d3
    assert "split: I = 1.2, W = 0.8" in out[-3]
    assert out[-1] == f"bubble ratio: {4.2 / (8 * 3 + 4.2):.6f}"
    assert " W0s3 " in open(text).read()
    assert main(["compare-schedules", "-D", "4", "-N", "8", "--bwd-ratio", "2", "--schedules", "1f1b", "zbv"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("1f1b", "zbv"))]
    assert [r[0] for r in rows] == ["1f1b", "zbv"] and float(rows[1][1]) == pytest.approx(3 / 51, abs=1e-4)
    with pytest.raises(SystemExit):
        main(["schedule", "zbv", "-D", "4", "-N", "8", "--weight-share", "1"])
    assert "must be between 0 and 1" in capsys.readouterr().err
