"""``pipeoptim.job``'s TrainConfig: the same run from the command line and from Python, its fields the flags with
their defaults, every field checked before torch loads, and ``job.run`` training a config made in Python."""
from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import subprocess
import sys

import pytest

from pipeoptim.cli import build_parser
from pipeoptim.errors import ConfigError
from pipeoptim.job import TrainConfig, check, run

PARSER_ONLY = {"command", "_given", "_run"}  # the subcommand's name and the parser's own bookkeeping


def _parsed(*flags):
    return build_parser().parse_args(["train", *flags])


def test_the_fields_are_the_flags_with_their_defaults():
    args = vars(_parsed())
    flags = {k: v for k, v in args.items() if k not in PARSER_ONLY}
    fields = TrainConfig.flag_names()
    assert sorted(fields) == sorted(flags), set(fields) ^ set(flags)
    default = TrainConfig()
    assert {name: getattr(default, name) for name in fields} == flags
    # the fields after the flags are filled in by the checks and the launcher, never by a flag
    filled = [f.name for f in dataclasses.fields(TrainConfig)][len(fields):]
    assert "d_model" in filled and "resume_from" in filled and not set(filled) & set(flags)


def test_the_command_line_and_python_make_the_same_checked_config():
    flags = ["--model", "tiny", "--stages", "2", "--schedule", "2bw", "--optimizer", "adamw", "--steps", "7",
             "--emulate", "--microbatches", "4"]
    from_cli = check(TrainConfig.from_args(_parsed(*flags)))
    from_python = check(TrainConfig(model="tiny", stages=2, schedule="2bw", optimizer="adamw", steps=7, emulate=True,
                                    microbatches=4))
    assert from_cli == from_python  # (``given``, the flags typed on the command line, is not compared)
    assert (from_python.policy, from_python.d_model, from_python.seq_len, from_python.lr) == ("2bw", 32, 32, 3e-3)
    assert pickle.loads(pickle.dumps(from_python)) == from_python  # the launcher sends it to every rank
    assert TrainConfig().replace(stages=8).stages == 8
    with pytest.raises(TypeError, match="stage"):
        TrainConfig().replace(stage=8)  # a misspelt field is never silently ignored


@pytest.mark.parametrize("change, says", [
    ({"stages": 0}, r"stages \(--stages\) must be a whole number >= 1, got 0"),
    ({"steps": 2.5}, r"steps \(--steps\) must be a whole number >= 1, got 2.5"),
    ({"microbatches": True}, r"microbatches \(--microbatches\) must be a whole number >= 1, got True"),
    ({"lr": -1e-3}, r"lr \(--lr\) must be None or a finite number > 0, got -0.001"),
    ({"clip": float("nan")}, r"clip \(--clip\) must be a finite number >= 0"),
    ({"schedule": "1F1B"}, r"schedule \(--schedule\) must be one of 'gpipe', '1f1b'"),
    ({"model": "huge"}, r"model \(--model\) must be one of 'tiny'"),
    ({"optimizer": "lamb"}, r"optimizer \(--optimizer\) must be one of 'adamw'"),
    ({"emulate": "yes"}, r"emulate \(--emulate\) must be True or False, got 'yes'"),
    ({"resume": "always"}, r"resume \(--resume\) must be one of False, True, 'auto', got 'always'"),
    ({"hf_set": "n_layer=2"}, r"hf_set \(--hf-set\) must be None or a list of 'KEY=VALUE' strings"),
    ({"checkpoint_stages": 3}, r"checkpoint_stages \(--checkpoint-stages\) must be None, True"),
    ({"checkpoint_stages": "one:2"}, r"checkpoint_stages \(--checkpoint-stages\): 'one:2': give 'all'"),
    ({"link": "latency=fast"}, r"link \(--link\):"),
    ({"resume": True, "overwrite": True}, r"give one of the two"),
])
def test_a_field_python_got_wrong_is_named_before_anything_runs(change, says, tmp_path):
    """The parser checks each flag; a TrainConfig made in Python skips it, so check() does the same (and the
    error names the field, its flag and what it takes)."""
    config = TrainConfig(**{"model": "tiny", "stages": 2, "emulate": True, "run_dir": str(tmp_path / "run"),
                            **change})
    with pytest.raises(ConfigError, match=says):
        check(config)
    assert run(config) == 2 and not (tmp_path / "run").exists()  # run says it on stderr and writes nothing


def test_a_recipe_from_python_compares_the_fields_that_differ_from_their_defaults():
    with pytest.raises(ConfigError, match="--recipe async-transformer sets --schedule 2bw but you gave --schedule "
                                          "gpipe"):
        check(TrainConfig(model="tiny", stages=4, recipe="async-transformer", schedule="gpipe"))
    made = check(TrainConfig(model="tiny", stages=4, recipe="async-transformer"))
    assert (made.schedule, made.optimizer, made.lr, made.lr_given) == ("2bw", "adamw", 5e-4, False)
    # on the command line a flag typed at its default value still contradicts the recipe (TrainConfig.given)
    with pytest.raises(ConfigError, match="sets --schedule 2bw but you gave --schedule async-1f1b"):
        check(TrainConfig.from_args(_parsed("--model", "tiny", "--recipe", "async-transformer", "--schedule",
                                            "async-1f1b")))


def test_checking_a_config_imports_no_torch():
    code = ("import sys; from pipeoptim.job import TrainConfig, check; "
            "c = check(TrainConfig(model='tiny', stages=2, emulate=True)); "
            "assert c.d_model == 32, c; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_run_trains_a_config_made_in_python_as_the_command_does(tmp_path, capsys, one_thread):
    config = TrainConfig(model="tiny", stages=2, schedule="1f1b", steps=2, emulate=True, no_progress=True,
                         run_dir=str(tmp_path / "py"))
    assert run(config) == 0
    from_python = capsys.readouterr().out.strip().splitlines()[-1]
    from pipeoptim.cli.train import main
    assert main(["--model", "tiny", "--stages", "2", "--schedule", "1f1b", "--steps", "2", "--emulate",
                 "--no-progress", "--run-dir", str(tmp_path / "cli")]) == 0
    from_cli = capsys.readouterr().out.strip().splitlines()[-1]
    assert from_python.startswith("final loss: ") and from_python == from_cli
    recorded = [json.loads((tmp_path / d / "history.json").read_text())["config"] for d in ("py", "cli")]
    assert {k: v for k, v in recorded[0].items() if k != "run_dir"} == \
        {k: v for k, v in recorded[1].items() if k != "run_dir"}
    assert recorded[0]["schedule"] == "1f1b" and recorded[0]["d_model"] == 32
    with pytest.raises(TypeError, match="run\\(\\) takes a pipeoptim.job.TrainConfig, not dict"):
        run({"model": "tiny"})


def test_from_args_reads_a_namespace_not_made_by_the_parser():
    """A namespace built by hand (a wrapper of the user's) has no record of the flags given: a recipe then
    compares with the defaults, as for a TrainConfig made in Python."""
    args = argparse.Namespace(**{name: getattr(TrainConfig(), name) for name in TrainConfig.flag_names()})
    args.model, args.stages = "tiny", 2
    config = TrainConfig.from_args(args)
    assert config.given is None and config == TrainConfig(model="tiny", stages=2)


def test_a_checked_config_is_not_checked_twice_and_its_resolved_flags_stay(tmp_path):
    """check() resolves flags (the lr a run without one gets, the model an hf_config builds): checking its result
    again would take those for the user's (lr_given True), so a checked config is returned as it is, and a flag
    of it cannot be replaced (a field check() fills in can)."""
    checked = check(TrainConfig(model="tiny", stages=2, emulate=True))
    assert checked.checked and not checked.lr_given and check(checked) is checked
    with pytest.raises(ValueError, match="lr: this TrainConfig was checked"):
        checked.replace(lr=1e-3)
    assert checked.replace(resume_from="somewhere").resume_from == "somewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.lr = 1e-3
    assert "checked" not in checked.to_dict() and checked.to_dict()["lr"] == checked.lr


def test_checkpoint_stages_takes_the_flags_spelling_from_python_too():
    config = TrainConfig(model="small", stages=2, schedule="1f1b", emulate=True)
    flags = ["--model", "small", "--stages", "2", "--schedule", "1f1b", "--emulate"]
    for spec in ("all", "0,1:0-1", "1:2"):
        from_python = check(config.replace(checkpoint_stages=spec))
        from_cli = check(TrainConfig.from_args(_parsed(*flags, "--checkpoint-stages", spec)))
        assert from_python.checkpoint_stages == from_cli.checkpoint_stages != spec, spec
    assert check(config.replace(checkpoint_stages="0,1:0-1")).checkpoint_stages == {0: "all", 1: [0, 1]}
