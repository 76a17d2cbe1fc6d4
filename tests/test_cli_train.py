"""`pipeoptim train` (pipeoptim/cli_train.py): the Hugging Face model choices train end to end, and bad device
requests fail before anything starts."""
from __future__ import annotations

import json

import pytest
import torch

from pipeoptim.cli_train import main


def test_hf_gpt2_trains_through_the_emulated_pipeline(tmp_path, capsys, one_thread):
    pytest.importorskip("transformers")
    rc = main(["--model", "hf-gpt2", "--emulate", "--steps", "3", "--microbatches", "4", "--microbatch-size", "2",
               "--run-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("final loss: ") and 0 < float(last.split(": ")[1]) < 6.0
    history = json.loads((tmp_path / "history.json").read_text())["history"]
    assert len(history) == 3 and history[-1]["loss"] < history[0]["loss"]
    saved = tmp_path / "checkpoint" / "step-00000003"
    assert (saved / "manifest.json").exists() and (saved / "part-0.pt").exists()


def test_hf_model_without_transformers_says_how_to_install(monkeypatch, capsys, tmp_path):
    import pipeoptim.models.hf as hf

    def missing():
        raise ImportError("Hugging Face models need the transformers package: pip install 'pipeoptim[hf]'")
    monkeypatch.setattr(hf, "require_transformers", missing)
    assert main(["--model", "hf-llama", "--emulate", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "pipeoptim[hf]" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_emulated_cuda_without_a_gpu_is_refused(capsys, tmp_path):
    # issue 15, defect 2: `--emulate --device cuda` must not fall back to the CPU in silence
    assert main(["--emulate", "--device", "cuda", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "--device cuda needs a GPU (--emulate runs every stage on one)" in capsys.readouterr().err


def test_delay_flags_train_and_resume_only_with_the_same_flags(tmp_path, capsys, one_thread):
    common = ["--model", "tiny", "--emulate", "--stages", "2", "--microbatches", "2", "--microbatch-size", "2",
              "--run-dir", str(tmp_path), "--no-progress"]
    delay = ["--delay-lr", "pipemare", "--delay-momentum", "nesterov", "--delay-warmup", "8"]
    assert main(common + delay + ["--steps", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("final loss: ")
    assert main(common + ["--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "written with --delay-lr pipemare --delay-momentum nesterov --delay-warmup 8" in err, err
    assert main(common + delay + ["--steps", "3", "--resume"]) == 0


def test_delay_flags_on_a_synchronous_schedule_are_refused(capsys, tmp_path):
    assert main(["--emulate", "--schedule", "1f1b", "--delay-momentum", "nesterov", "--steps", "1",
                 "--run-dir", str(tmp_path)]) == 2
    assert "--schedule 1f1b is synchronous" in capsys.readouterr().err
    assert main(["--emulate", "--delay-lr", "pipemare", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "--delay-warmup K" in capsys.readouterr().err


def test_muon_and_nadam_train_with_last_update_prediction(tmp_path, capsys, one_thread):
    common = ["--model", "tiny", "--emulate", "--stages", "2", "--microbatches", "2", "--microbatch-size", "2",
              "--no-progress", "--steps", "2"]
    assert main(common + ["--optimizer", "muon", "--lr", "0.02", "--run-dir", str(tmp_path / "m")]) == 2
    assert "--predict-from last_update" in capsys.readouterr().err
    assert main(common + ["--optimizer", "muon", "--lr", "0.02", "--predict-from", "last_update",
                          "--run-dir", str(tmp_path / "m")]) == 0
    assert main(common + ["--optimizer", "nadam", "--momentum", "0.99", "--run-dir", str(tmp_path / "n")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("final loss: ")
    assert main(common + ["--policy", "stash", "--predict-from", "last_update", "--run-dir", str(tmp_path / "s")]) == 2
    assert "--policy pipeoptim" in capsys.readouterr().err


def test_dc_flag_needs_the_stash_policy(tmp_path, capsys, one_thread):
    common = ["--model", "tiny", "--emulate", "--stages", "2", "--microbatches", "2", "--microbatch-size", "2",
              "--no-progress", "--steps", "1", "--dc", "2.0"]
    assert main(common + ["--run-dir", str(tmp_path / "a")]) == 2
    assert "use it with --policy stash" in capsys.readouterr().err
    assert main(common + ["--policy", "stash", "--run-dir", str(tmp_path / "b")]) == 0


def test_train_flags_are_read_without_loading_torch():
    # the --delay-* choices come from pipeoptim.delay, which must not load torch for `pipeoptim train --help`
    import subprocess
    import sys
    code = ("import sys, argparse; from pipeoptim.cli_train import add_arguments; "
            "add_arguments(argparse.ArgumentParser()).parse_args(['--delay-lr', 'graphcore']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"


def test_momentum_out_of_range_is_refused(tmp_path, capsys):
    assert main(["--emulate", "--momentum", "1.0", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "--momentum must be in [0, 1)" in capsys.readouterr().err
