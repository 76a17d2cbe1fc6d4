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
