"""`pipeoptim train --hf-config/--hf-set` (pipeoptim/cli/train.py): the CLI trains a Hugging Face family it had no
--model for (Qwen3) from a config file the test writes, refuses a bad flag before anything runs, and a resume
refuses a changed --hf-config/--hf-set or an edited config file."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from pipeoptim.cli.train import main  # noqa: E402


def _qwen3(folder):
    transformers.Qwen3Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, vocab_size=151936).save_pretrained(folder)
    return folder / "config.json"


def test_the_cli_trains_a_qwen3_from_its_config_and_a_resume_must_keep_it(tmp_path, capsys, one_thread):
    config = _qwen3(tmp_path / "model")
    common = ["--emulate", "--stages", "2", "--microbatches", "2", "--microbatch-size", "4", "--optimizer", "adamw",
              "--lr", "3e-3", "--no-progress", "--run-dir", str(tmp_path / "run")]
    run = ["--hf-config", str(config), "--hf-set", "num_hidden_layers=3", *common]
    assert main([*run, "--steps", "6"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "--hf-config: vocab_size 151936 -> 256 (bytes, no --tokenizer)" in err
    saved = json.loads((tmp_path / "run" / "history.json").read_text())
    assert saved["config"]["model"] == "hf-qwen3" and saved["config"]["n_layers"] == 3
    losses = [h["loss"] for h in saved["history"]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses  # it learns (from ln 256 = 5.55)
    assert out.strip().splitlines()[-1].startswith("final loss: ")
    # a resume must build the same model
    assert main(["--hf-config", str(config), "--hf-set", "num_hidden_layers=2", *common, "--steps", "7",
                 "--resume"]) == 2
    assert "was written with --hf-set ['num_hidden_layers=3'] and this run asks for --hf-set " \
           "['num_hidden_layers=2']" in capsys.readouterr().err
    other = _qwen3(tmp_path / "other")
    assert main([*run[:1], str(other), *run[2:], "--steps", "7", "--resume"]) == 2
    assert f"was written with --hf-config {config}" in capsys.readouterr().err
    edited = json.loads(config.read_text())
    edited["intermediate_size"] = 96  # same path, another model
    config.write_text(json.dumps(edited))
    assert main([*run, "--steps", "7", "--resume"]) == 2
    assert "the model that --hf-config builds has changed (its config.json was edited?)" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--hf-set", "num_layers=2"], "the qwen3 config has no key 'num_layers'"),
    (["--hf-set", "hidden_size=big"], "hidden_size is a whole number (now 32), not 'big'"),
    (["--model", "tiny"], "is the model; drop --model tiny"),
])
def test_a_bad_hf_flag_is_refused_before_anything_runs(tmp_path, capsys, flags, message):
    config = _qwen3(tmp_path / "model")
    assert main(["--hf-config", str(config), *flags, "--emulate", "--steps", "1", "--run-dir",
                 str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_a_config_that_needs_custom_code_is_refused_saying_so(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "brand_new", "auto_map": {"AutoConfig": "x.C"}}))
    assert main(["--hf-config", str(tmp_path), "--emulate", "--steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    assert "needs custom code" in capsys.readouterr().err


def test_hf_set_without_hf_config_is_refused(tmp_path, capsys):
    assert main(["--hf-set", "num_hidden_layers=2", "--emulate", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "--hf-set changes the config of --hf-config; give --hf-config PATH_OR_NAME too" in capsys.readouterr().err


def test_a_gpt2_or_llama_config_with_a_tokenizer_is_not_taken_for_a_built_in_model(tmp_path):
    """Regression: --hf-config of a gpt2 (or llama) config with --tokenizer was refused with "drop --model
    hf-gpt2": resolving the config again at the tokenizer's vocabulary met the model name the first resolution had
    set, which is also a built-in --model's."""
    from test_cli_train import _local_tokenizer, _some_text

    from pipeoptim.cli import build_parser
    from pipeoptim.cli.train import _config
    text = tmp_path / "corpus.txt"
    text.write_bytes(_some_text())
    vocab = _local_tokenizer(tmp_path / "tok", text.read_bytes())
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64).save_pretrained(tmp_path / "model")
    cfg = _config(build_parser().parse_args(
        ["train", "--hf-config", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok"), "--data", str(text),
         "--stages", "2", "--emulate"]))
    assert (cfg.model, cfg.vocab_size, cfg.hf_spec["model_type"]) == ("hf-gpt2", vocab, "gpt2")
    assert f"vocab_size 50257 -> {vocab}" in " ".join(cfg.hf_spec["notes"])
