"""The `pipeoptim` command line refuses what it does not know, says every default, and answers a wrong
configuration before torch is loaded (issue 22, sections 2 and 3). Nothing here trains."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import fault_harness as fh
from pipeoptim.cli import build_parser

SUBCOMMANDS = ("schedule", "compare-schedules", "train")


def _subparser(name):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["train", "--schedule", "async1f1b"], "argument --schedule: invalid choice: 'async1f1b'"),
    (["train", "--policy", "pipeoptimm"], "argument --policy: invalid choice: 'pipeoptimm'"),
    (["train", "--optimizer", "adamw2"], "argument --optimizer: invalid choice"),
    (["train", "--resum"], "unrecognized arguments: --resum"),         # not taken as --resume
    (["train", "--sched", "1f1b"], "unrecognized arguments: --sched"),
    (["train", "--resume", "--overwrite"], "not allowed with argument"),
    (["train", "--lr", "-1"], "must be a positive number"),
    (["train", "--stages", "0"], "must be a positive integer"),
    (["schedule", "async1f1b", "-D", "4", "-N", "8"], "invalid choice: 'async1f1b'"),
    (["schedule", "1f1b", "-D", "4", "-N", "8", "--bwd", "3"], "unrecognized arguments: --bwd"),
    (["compare-schedules", "--schedules", "1f1b", "bitpip"], "invalid choice: 'bitpip'"),
    (["compare-schedules", "--bwd", "2"], "unrecognized arguments: --bwd"),
])
def test_unknown_values_and_abbreviations_are_refused(argv, says, capsys):
    assert says in _refused(argv, capsys)


def test_train_offers_every_schedule_that_pipeoptim_schedule_knows():
    def choices(parser, dest):
        return next(a.choices for a in parser._actions if a.dest == dest)
    from pipeoptim.schedules import SCHEDULES
    assert list(choices(_subparser("train"), "schedule")) == list(SCHEDULES)
    assert list(choices(_subparser("schedule"), "name")) == list(SCHEDULES)
    assert {"zb-h1", "zbv", "dualpipev", "async-zb"} <= set(SCHEDULES)


def _help_entries(parser) -> dict[str, str]:
    """Option -> its --help entry (options, metavar and help text, unwrapped)."""
    lines = parser.format_help().split("options:", 1)[1].splitlines()
    entries, current = {}, None
    for line in lines:
        if re.match(r"^  -", line):
            current = re.match(r"^  (-[-\w]+)", line).group(1)
            entries[current] = ""
        if current:
            entries[current] += " " + line.strip()
    return entries


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_names_the_default_of_every_option(name):
    parser = _subparser(name)
    entries = _help_entries(parser)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 10 and len(entries) == len(options) + 1  # + -h
    for action in (a for a in options if not a.required):
        entry = entries[action.option_strings[0]]
        assert "(default" in entry, f"pipeoptim {name} --help: {entry!r} gives no default"
    if name == "train":
        assert ("(default: 0.008 for async-1f1b with muon, the default pair; 0.00075 for async-1f1b with adamw; "
                "0.003 otherwise") in entries["--lr"]
        for flag, default in [("--optimizer", "muon"), ("--run-dir", "runs/train"),
                              ("--seed", "0"), ("--schedule", "async-1f1b"), ("--emulate", "off")]:
            assert f"(default: {default})" in entries[flag], entries[flag]


_PROBE = """
import json, sys, time
from pipeoptim.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    t0 = time.perf_counter()
    rc = main(argv)
    out.append((rc, time.perf_counter() - t0))
heavy = sorted(m for m in ("torch", "triton", "pipeoptim_kernels", "transformers", "numpy") if m in sys.modules)
print(json.dumps({"runs": out, "heavy": heavy}))
"""


def test_configuration_errors_are_answered_before_torch_is_imported(tmp_path):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_bytes(b"")
    short.write_text("print('hello')\n" * 20)  # 300 bytes: 15 held out, too few for a window of 64
    used = tmp_path / "used"
    (used / "checkpoint" / "step-00000004").mkdir(parents=True)
    cases = [
        (["--schedule", "bitpipe", "--stages", "3"], "bitpipe needs an even number of devices"),
        (["--data", str(tmp_path / "missing.txt")], f"--data: {tmp_path / 'missing.txt'} does not exist"),
        (["--data", str(empty)], f"--data: {empty} is empty"),
        (["--data", str(short)], "too short for one window of 64 bytes"),
        (["--data", str(tmp_path / "nothing")], ""),
        (["--run-dir", str(used)], "continue it with --resume, or start afresh with --overwrite"),
        (["--resume", "--run-dir", str(tmp_path / "new")], "a run writes one every --save-every windows"),
        (["--tokenizer", "gpt2"], "--tokenizer needs a Hugging Face model (--model hf-gpt2 or hf-llama)"),
    ]
    (tmp_path / "nothing").mkdir()
    cases[4] = (cases[4][0], f"the folder {tmp_path / 'nothing'} holds no files")
    argv = [["train", *a, *([] if "--run-dir" in a else ["--run-dir", str(tmp_path / "r")])] for a, _ in cases]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                          timeout=120, env=fh.env())  # this source tree first on the path
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [rc for rc, _ in result["runs"]] == [2] * len(cases), proc.stderr
    for _, says in cases:
        assert says in proc.stderr, (says, proc.stderr)
    assert "Pipeline.save" not in proc.stderr  # advice in terms of the command line
    assert result["heavy"] == [], f"imported before the configuration was checked: {result['heavy']}"
    assert not (tmp_path / "r" / "checkpoint").exists() and not (used / "history.json").exists()
