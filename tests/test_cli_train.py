"""`pipeoptim train` (pipeoptim/cli/train.py): the Hugging Face model choices and every schedule train end to end;
bad device requests fail before anything starts; a run directory is never silently overwritten; --resume applies
a new --lr/--clip and refuses what cannot change; --data/--tokenizer train on the user's text; what a run leaves
behind (strict history.json with validation points, loss.png) and what its progress bar says on a crowded CPU."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipeoptim.cli.train import ASYNC_1F1B_MUON_LR, _optimizer, main
from pipeoptim.job import TrainConfig
from pipeoptim.runtime.plan import ConfigError


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


TINY = ["--model", "tiny", "--stages", "2", "--microbatches", "4", "--microbatch-size", "1", "--emulate",
        "--no-progress"]


def _strict(path):
    """history.json read as strict JSON: a bare NaN or Infinity fails."""
    def refuse(name):
        raise ValueError(f"{path} holds {name}: not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev", "async-zb"])
def test_the_split_backward_schedules_train_too(schedule, tmp_path, capsys, one_thread):
    # issue 22.2: `pipeoptim train --schedule` offered 7 of the 11 schedules that `pipeoptim schedule` knows
    rc = main([*TINY, "--schedule", schedule, "--steps", "2", "--run-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert 0 < float(out.strip().splitlines()[-1].removeprefix("final loss: ")) < 6.0
    assert (tmp_path / "checkpoint" / "step-00000002" / "manifest.json").exists()


def test_history_is_strict_json_with_validation_points_and_a_picture(tmp_path, capsys, one_thread):
    # issue 22.5: grad_norm was a bare NaN in every row (async schedules have no global norm); no validation
    rc = main([*TINY, "--schedule", "async-1f1b", "--steps", "4", "--eval-every", "2", "--run-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    rows = _strict(tmp_path / "history.json")["history"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["val_loss"] is not None for r in rows] == [False, True, False, True]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # issue 45.7: grad_norm was null in every asynchronous row; it is the largest per-stage norm of the window's
    # updates (what each stage clips by), on every rank alike
    assert all(isinstance(r["grad_norm"], float) and r["grad_norm"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert f"validation loss {rows[-1]['val_loss']:.4f}" in out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_a_stream_trains_resumes_and_equals_an_uninterrupted_stream(tmp_path, capsys, one_thread):
    """--stream: the checkpoint of step 2 is written after a drain, so the run resumed from it and the one that
    went on end at the same loss."""
    common = [*TINY, "--stream", "--save-every", "2", "--eval-every", "0", "--steps", "4"]
    assert main([*common, "--run-dir", str(tmp_path / "on")]) == 0, capsys.readouterr().err
    on = capsys.readouterr().out.strip().splitlines()[-1]
    shutil.copytree(tmp_path / "on", tmp_path / "re")
    shutil.rmtree(tmp_path / "re" / "checkpoint" / "step-00000004")  # resume from the mid-run checkpoint
    assert main([*common, "--resume", "--run-dir", str(tmp_path / "re")]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip().splitlines()[-1] == on
    went_on, resumed = (_strict(tmp_path / d / "history.json")["history"] for d in ("on", "re"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in went_on]  # bit for bit, steps 3 and 4 included
    assert main([*TINY, "--stream", "--schedule", "1f1b", "--steps", "1", "--run-dir", str(tmp_path / "s")]) == 2
    assert "stream=True" in capsys.readouterr().err


def test_update_every_sets_2bws_steps_per_window_and_a_resume_must_keep_them(tmp_path, capsys, monkeypatch,
                                                                             one_thread):
    """--update-every M reaches the schedule, the pipeline and the learning-rate schedule's count of steps; M =
    --microbatches is one step per window; a resume with another M (another number of steps per window) is
    refused, naming both; a schedule other than 2bw refuses the flag."""
    from pipeoptim.cli import train as cli_train
    run = cli_train.TrainConfig(schedule="2bw", stages=2, microbatches=4)
    assert cli_train._updates_per_window(run) == 2 and cli_train._updates_per_window(run.replace(update_every=4)) == 1
    common = [*TINY, "--schedule", "2bw", "--stream", "--eval-every", "0", "--run-dir", str(tmp_path)]
    import pipeoptim.train as train_module
    built = []

    class Spy(train_module.Pipeline):  # the run imports the Pipeline from pipeoptim.train when it starts
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)
    monkeypatch.setattr(train_module, "Pipeline", Spy)
    assert main([*common, "--update-every", "4", "--steps", "2"]) == 0, capsys.readouterr().err
    monkeypatch.undo()
    assert [st.policy.update_every for w in built[0].workers for st in w.stages.values()] == [4, 4]
    capsys.readouterr()
    assert main([*common, "--steps", "3", "--resume"]) == 2  # the default, --stages 2: two steps per window
    err = capsys.readouterr().err
    assert "2bw with 4 micro-batches and --update-every 4 (1 optimizer steps per window); 2bw with 4 " \
           "micro-batches takes 2" in err, err
    assert "--update-every that step as often" in err, err
    assert main([*common, "--steps", "3", "--resume", "--update-every", "4"]) == 0, capsys.readouterr().err
    assert main([*TINY, "--schedule", "1f1b", "--update-every", "4", "--run-dir", str(tmp_path / "x")]) == 2
    assert "--update-every applies to the 2bw schedule only" in capsys.readouterr().err


def test_the_loss_picture_draws_validation_beside_training():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeoptim.viz import plot_training
    rows = [{"step": s, "loss": 5.0 - s / 10, "val_loss": (5.1 - s / 10 if s % 2 == 0 else None)} for s in range(1, 7)]
    fig, ax = plt.subplots()
    plot_training(ax, rows)
    (train, val) = ax.get_lines()
    assert list(val.get_xdata()) == [2, 4, 6] and list(train.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["training", "validation (held-out batch)"]
    plt.close(fig)


def test_a_run_dir_holding_a_checkpoint_needs_resume_or_overwrite(tmp_path, capsys, one_thread):
    # issue 22.2: a second run in the same --run-dir silently overwrote the first run's checkpoint and history
    common = [*TINY, "--schedule", "1f1b", "--run-dir", str(tmp_path)]
    assert main([*common, "--steps", "2"]) == 0
    capsys.readouterr()
    first = (tmp_path / "history.json").read_text()
    assert main([*common, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} holds an earlier run (checkpoints up to step 2" in err and "--resume" in err \
        and "--overwrite" in err, err
    assert (tmp_path / "history.json").read_text() == first
    assert (tmp_path / "checkpoint" / "step-00000002" / "manifest.json").exists()
    assert main([*common, "--steps", "1", "--overwrite"]) == 0
    assert "--overwrite: deleted the earlier run's checkpoints" in capsys.readouterr().err
    assert [r["step"] for r in _strict(tmp_path / "history.json")["history"]] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-00000001"]


def test_resume_auto_starts_afresh_without_a_committed_checkpoint_and_resumes_with_one(tmp_path, capsys, one_thread):
    common = [*TINY, "--schedule", "1f1b", "--run-dir", str(tmp_path / "run"), "--resume", "auto"]
    assert main([*common, "--steps", "2"]) == 0  # the first start: nothing to resume
    assert "resuming" not in capsys.readouterr().err
    assert main([*common, "--steps", "3"]) == 0
    assert f"resuming from {tmp_path}/run/checkpoint/step-00000002 (step 2 of 3)" in capsys.readouterr().err
    assert [r["step"] for r in _strict(tmp_path / "run" / "history.json")["history"]] == [1, 2, 3]
    # a run stopped while writing its first checkpoint left an uncommitted step: nothing to lose, start afresh
    debris = tmp_path / "debris"
    (debris / "checkpoint" / "step-00000004").mkdir(parents=True)
    (debris / "checkpoint" / "step-00000004" / "part-0.pt").write_bytes(b"half")
    assert main([*TINY, "--schedule", "1f1b", "--run-dir", str(debris), "--resume", "auto", "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "--resume auto:" in err and "holds no committed checkpoint" in err and "starting afresh" in err, err
    assert [r["step"] for r in _strict(debris / "history.json")["history"]] == [1]
    # a committed checkpoint that is damaged is not nothing: refused, as plain --resume refuses it
    (tmp_path / "run" / "checkpoint" / "step-00000003" / "meta.pt").write_bytes(b"not a checkpoint")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-00000002")
    assert main([*common, "--steps", "4"]) == 2
    assert "no intact checkpoint" in capsys.readouterr().err


def test_resume_applies_a_new_lr_and_clip_and_refuses_a_new_seed(tmp_path, capsys, one_thread):
    # issue 21.4: --resume --lr X kept the checkpoint's lr in silence (so the NaN stop's advice to lower it could
    # not work). Here the new lr is absurd: applied, it drives the loss to NaN, where the old one trained on.
    common = [*TINY, "--schedule", "1f1b", "--optimizer", "sgd", "--run-dir", str(tmp_path)]
    assert main([*common, "--steps", "2", "--lr", "0.01"]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "6", "--lr", "0.01", "--resume", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "written with --seed 0 and this run asks for --seed 1: a resumed run continues the checkpoint's " \
           "random state" in err, err
    rc = main([*common, "--steps", "6", "--resume", "--lr", "1e30", "--clip", "0"])
    err = capsys.readouterr().err
    assert "--lr 1e+30 applies from step 2 on: the checkpoint was written with --lr 0.01" in err, err
    assert "--clip 0 (off) applies from here on: the checkpoint was written with --clip 1" in err, err
    assert rc == 3 and "the loss was nan" in err, err
    assert "a lower --lr" in err  # the stop's advice, in terms of the flags that now work
    rows = _strict(tmp_path / "history.json")["history"]  # the NaN loss is null
    assert rows[-1]["loss"] is None and [r["step"] for r in rows[:2]] == [1, 2]


def test_without_lr_a_run_gets_its_pairs_measured_best_and_a_resume_keeps_the_checkpoints(tmp_path, capsys,
                                                                                          one_thread):
    # The main job ran at 3e-3, 4x the best of its own sweep (README, "Windows or a stream": async 1F1B with
    # AdamW learned best at 7.5e-4, validation 2.051 against 2.223, 3 seeds). Each default pair now gets its
    # measured best; a resume without --lr keeps the checkpoint's, whatever the default says.
    from pipeoptim.cli import build_parser
    from pipeoptim.cli.train import _config

    def cfg(*flags):
        return _config(build_parser().parse_args(["train", "--model", "tiny", "--emulate", *flags]))
    assert (cfg().lr, cfg().lr_given) == (ASYNC_1F1B_MUON_LR, False)
    assert (cfg("--optimizer", "adamw").lr, cfg("--optimizer", "adamw").lr_given) == (7.5e-4, False)
    for other in (["--schedule", "1f1b"], ["--optimizer", "sgd"]):
        assert cfg(*other).lr == 3e-3, other
    # a recipe runs at the lr its evidence was measured at (issue 45.5: it got 3e-3, never measured)
    assert (cfg("--recipe", "async-transformer").lr, cfg("--recipe", "async-transformer").lr_given) == \
        (5e-4, False)
    assert (cfg("--lr", "0.01").lr, cfg("--lr", "0.01").lr_given) == (0.01, True)

    common = [*TINY, "--optimizer", "adamw", "--run-dir", str(tmp_path)]
    assert main([*common, "--steps", "2"]) == 0
    assert _strict(tmp_path / "history.json")["config"]["lr"] == 7.5e-4
    assert main([*common, "--steps", "2", "--overwrite", "--lr", "0.002"]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "3", "--resume"]) == 0
    assert "applies from step" not in capsys.readouterr().err  # the checkpoint's 0.002 stays: no default replaces it
    saved = torch.load(tmp_path / "checkpoint" / "step-00000003" / "part-0.pt", weights_only=True)
    peaks = {v for k, v in _items(saved) if k.endswith("initial_lr")}
    assert peaks == {0.002}, peaks


def test_the_default_is_async_1f1b_with_pipeoptims_prediction_from_the_last_update_and_muon(tmp_path):
    # issue 45.6: the main job's default was async 1F1B + AdamW, the configuration the docs advise Transformer
    # users against; it is now the measured best asynchronous configuration of the main run, with every coupled
    # default (Muon's scale, its weight decay, PipeOptim's Δ, the lr) resolved to what was measured
    from pipeoptim.cli import build_parser
    from pipeoptim.cli.train import _config

    def cfg(*flags):
        return _config(build_parser().parse_args(["train", "--model", "tiny", "--emulate", *flags]))
    default = cfg()
    assert {k: getattr(default, k) for k in ("schedule", "policy", "optimizer", "predict_from", "muon_scale", "lr")} == \
        {"schedule": "async-1f1b", "policy": "pipeoptim", "optimizer": "muon", "predict_from": "last_update",
         "muon_scale": "adamw", "lr": ASYNC_1F1B_MUON_LR}
    made = _optimizer(default)([torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))])
    groups = {type(o).__name__: o.param_groups[0] for o in made}
    assert groups["Muon"]["weight_decay"] == groups["AdamW"]["weight_decay"] == 0.1
    assert groups["Muon"]["momentum"] == 0.95 and groups["Muon"]["adjust_lr_fn"] == "match_rms_adamw"
    # the other optimizers keep their own defaults, and Muon's flags do not follow them there
    adamw = cfg("--optimizer", "adamw")
    assert (adamw.predict_from, adamw.muon_scale, adamw.lr) == ("optimizer", None, 7.5e-4)
    assert cfg("--policy", "stash").predict_from == "optimizer"  # stashing predicts nothing
    with pytest.raises(ConfigError, match="--muon-scale original sets how Muon scales its update, but the "
                                          "optimizer is adamw"):
        cfg("--optimizer", "adamw", "--muon-scale", "original")
    with pytest.raises(ConfigError, match="--optimizer muon has no prediction rule of its own"):
        cfg("--predict-from", "optimizer")


def test_a_resume_with_another_muon_scale_is_refused_naming_it(tmp_path, capsys, one_thread):
    # Muon's scale changed its default with the main job's: a checkpoint written at torch's own scale resumed
    # without --muon-scale would continue at another step size, silently
    common = [*TINY, "--save-every", "2", "--run-dir", str(tmp_path)]
    assert main([*common, "--steps", "2", "--muon-scale", "original"]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "3", "--resume"]) == 2
    assert ("was written with --muon-scale original and this run asks for --muon-scale adamw: Muon's steps would "
            "change size") in capsys.readouterr().err
    assert main([*common, "--steps", "3", "--resume", "--muon-scale", "original"]) == 0


def _items(tree, prefix=""):
    """Every (dotted key, leaf) of a checkpoint part's nested dicts and lists."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _items(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _items(v, f"{prefix}.{i}")
    else:
        yield prefix, tree


def _some_text() -> bytes:
    import json as json_module
    from pathlib import Path
    return (Path(json_module.__file__).parent / "encoder.py").read_bytes()  # ~16 kB of real text


def test_data_trains_on_a_users_text_file(tmp_path, capsys, one_thread):
    # issue 22.4: train only ever read the standard library's source
    text = tmp_path / "corpus.txt"
    text.write_bytes(_some_text())
    rc = main([*TINY, "--schedule", "1f1b", "--data", str(text), "--steps", "2", "--run-dir", str(tmp_path / "r")])
    assert rc == 0, capsys.readouterr().err
    history = _strict(tmp_path / "r" / "history.json")
    assert history["config"]["data"] == str(text) and history["history"][-1]["val_loss"] > 0


def _local_tokenizer(folder, text: bytes) -> int:
    """A byte-level BPE tokenizer trained here on ``text`` and saved with save_pretrained (nothing downloaded);
    returns its vocabulary size."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text.decode()], trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    tok.save(str(folder / "tokenizer-only.json"))
    return tok.get_vocab_size()


def test_tokenizer_sets_the_vocabulary_of_a_hugging_face_model(tmp_path, capsys, one_thread):
    text = tmp_path / "corpus.txt"
    text.write_bytes(_some_text())
    vocab = _local_tokenizer(tmp_path / "tok", text.read_bytes())
    assert 256 < vocab <= 320
    from pipeoptim.data import load_tokenizer
    for where in (tmp_path / "tok", tmp_path / "tok" / "tokenizer-only.json"):  # a folder, or a tokenizer.json
        encode, size = load_tokenizer(str(where))
        assert size == vocab and len(encode("def encode(self, o):")) < len("def encode(self, o):")
    run = tmp_path / "run"
    common = ["--model", "hf-gpt2", "--stages", "2", "--schedule", "1f1b", "--microbatches", "2",
              "--microbatch-size", "2", "--emulate", "--no-progress", "--data", str(text), "--run-dir", str(run)]
    rc = main([*common, "--tokenizer", str(tmp_path / "tok"), "--steps", "2"])
    assert rc == 0, capsys.readouterr().err
    part = torch.load(run / "checkpoint" / "step-00000002" / "part-0.pt", weights_only=False)
    assert any(v.shape == (vocab, 64) for v in part["params"].values())  # token embedding: one row per token
    capsys.readouterr()
    assert main([*common, "--steps", "3", "--resume"]) == 2  # bytes now: the embedding rows mean other things
    assert f"written with --tokenizer {tmp_path / 'tok'} and this run asks for no --tokenizer" in \
        capsys.readouterr().err
    assert main([*common, "--tokenizer", str(tmp_path / "none"), "--steps", "1", "--overwrite"]) == 2
    assert f"no tokenizer found at '{tmp_path / 'none'}'" in capsys.readouterr().err


def test_more_ranks_than_cores_says_the_idle_share_measures_the_machine(tmp_path):
    # issue 22.5: `bubble=70%` for async-1f1b (bubble-free) on a 2-core machine running 4 ranks
    import os
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "pipeoptim.cli", "train", *TINY[:-2], "--schedule", "async-1f1b", "--steps", "1",
           "--run-dir", str(tmp_path)]
    import fault_harness as fh
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=fh.env(),
                          preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert proc.returncode == 0, proc.stderr
    assert "2 ranks share 1 CPU core(s): the progress bar's 'idle' is each rank's idle share" in proc.stderr
    assert "idle=" in proc.stderr and "bubble=" not in proc.stderr
    assert "idle " in proc.stdout and "(2 ranks on 1 core(s): it measures the machine" in proc.stdout
    _strict(tmp_path / "history.json")  # written by rank 0 of a real multi-process run


SEEDED_FINAL_LOSS, TOLERANCE = 2.9668, 1e-3  # README "The main job": the seeded number and what it may vary by


def test_the_seeded_final_loss_is_the_recorded_one_within_the_readme_tolerance(tmp_path, capsys, one_thread):
    # 20 windows of the tiny GPT, async-1f1b + PipeOptim + AdamW, emulated, one thread. On this machine the
    # AVX-512, AVX2 and generic loops (ATEN_CPU_CAPABILITY, PIPEOPTIM_CPU_ISA) gave it to within 1e-7; over the
    # default 200 windows the instruction set moves the 4th significant digit (README)
    # (at --lr 3e-3 with AdamW, the main job's default before the default pair got its own measured best and
    # then Muon: the number verified there)
    rc = main(["--model", "tiny", "--stages", "2", "--microbatches", "4", "--microbatch-size", "2", "--steps", "20",
               "--lr", "3e-3", "--optimizer", "adamw", "--emulate", "--no-progress", "--eval-every", "0",
               "--run-dir", str(tmp_path)])
    assert rc == 0
    final = float(capsys.readouterr().out.strip().splitlines()[-1].removeprefix("final loss: "))
    assert abs(final - SEEDED_FINAL_LOSS) <= TOLERANCE, final

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


def test_a_new_lr_on_resume_goes_through_the_delay_rules(tmp_path, capsys, one_thread):
    # merge regression: --resume --lr read the LR schedule's base_lrs off the delay-aware wrapper (AttributeError)
    common = ["--model", "tiny", "--emulate", "--stages", "2", "--microbatches", "2", "--microbatch-size", "2",
              "--run-dir", str(tmp_path), "--no-progress", "--delay-lr", "graphcore", "--delay-warmup", "2"]
    assert main(common + ["--steps", "2", "--lr", "0.002"]) == 0
    capsys.readouterr()
    assert main(common + ["--steps", "3", "--lr", "0.004", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "--lr 0.004 applies from step 2 on: the checkpoint was written with --lr 0.002" in err, err


def test_delay_flags_on_a_synchronous_schedule_are_refused(capsys, tmp_path):
    assert main(["--emulate", "--schedule", "1f1b", "--delay-momentum", "nesterov", "--steps", "1",
                 "--run-dir", str(tmp_path)]) == 2
    assert "--schedule 1f1b is synchronous" in capsys.readouterr().err
    assert main(["--emulate", "--delay-lr", "pipemare", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "--delay-warmup K" in capsys.readouterr().err


def test_muon_and_nadam_train_with_last_update_prediction(tmp_path, capsys, one_thread):
    common = ["--model", "tiny", "--emulate", "--stages", "2", "--microbatches", "2", "--microbatch-size", "2",
              "--no-progress", "--steps", "2"]
    # Muon has no rule of its own to predict with: asking for one is refused; without --predict-from it predicts
    # from the last update (the default since Muon became the main job's optimizer)
    assert main(common + ["--optimizer", "muon", "--lr", "0.02", "--predict-from", "optimizer",
                          "--run-dir", str(tmp_path / "m")]) == 2
    assert "--predict-from last_update" in capsys.readouterr().err
    assert main(common + ["--optimizer", "muon", "--lr", "0.02", "--run-dir", str(tmp_path / "m")]) == 0
    assert _strict(tmp_path / "m" / "history.json")["config"]["predict_from"] == "last_update"
    assert main(common + ["--optimizer", "muon", "--lr", "0.02", "--predict-from", "last_update", "--overwrite",
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
    code = ("import sys, argparse; from pipeoptim.cli.train import add_arguments; "
            "add_arguments(argparse.ArgumentParser()).parse_args(['--delay-lr', 'graphcore']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"


def test_momentum_out_of_range_is_refused(tmp_path, capsys):
    assert main(["--emulate", "--momentum", "1.0", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "--momentum must be in [0, 1)" in capsys.readouterr().err


def test_dp_trains_two_replicas_on_distinct_rows_as_one_pipeline_on_the_doubled_batch(tmp_path, capsys, one_thread):
    # issue 24.2: `--dp 2 --stages 2` is 4 processes; each window draws 2 x 4 rows and replica q trains on its
    # q-th 4, so a synchronous schedule's losses (training and validation) are those of one pipeline on all 8
    # rows; had both replicas read the same rows, they would be those of one pipeline on 4 rows
    common = ["--model", "tiny", "--stages", "2", "--microbatches", "4", "--schedule", "1f1b", "--steps", "3",
              "--eval-every", "0", "--no-progress"]

    def losses(*flags, run):
        assert main([*common, *flags, "--run-dir", str(tmp_path / run)]) == 0, capsys.readouterr().err
        rows = _strict(tmp_path / run / "history.json")["history"]
        return [r["loss"] for r in rows] + [rows[-1]["val_loss"]]
    dp = losses("--dp", "2", "--microbatch-size", "1", run="dp")
    assert sorted(p.name for p in (tmp_path / "dp" / "checkpoint" / "step-00000003").glob("part-*.pt")) == \
        [f"part-{r}.pt" for r in range(4)]  # every rank of both replicas wrote its part
    doubled = losses("--emulate", "--microbatch-size", "2", run="doubled")
    assert dp == pytest.approx(doubled, rel=1e-5)
    single = losses("--emulate", "--microbatch-size", "1", run="single")
    assert abs(dp[0] - single[0]) > 1e-3


def test_dp_with_emulate_is_refused_with_the_equivalent_run(tmp_path, capsys):
    assert main(["--emulate", "--dp", "2", "--microbatch-size", "3", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert "--dp 1 --microbatch-size 6" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dp", "0", "--run-dir", str(tmp_path)])


# ---- issue 44: refuse early what would fail late; outputs that follow every checkpoint -------------------
def test_a_run_dir_whose_checkpoint_is_a_file_is_refused_before_anything_trains(tmp_path, capsys):
    # issue 44: with --resume auto this trained and then failed at the first save, its compute lost
    (tmp_path / "checkpoint").write_text("not a folder")
    assert main([*TINY, "--run-dir", str(tmp_path), "--resume", "auto", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'checkpoint'} is a file, but pipeoptim train writes a folder there (checkpoint); move it " \
           "away, or give this run another --run-dir" in err, err
    assert not (tmp_path / "history.json").exists()
    (tmp_path / "file").write_text("x")
    assert main([*TINY, "--run-dir", str(tmp_path / "file"), "--steps", "1"]) == 2
    assert f"--run-dir {tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err
    assert main([*TINY, "--run-dir", str(tmp_path / "file" / "run"), "--steps", "1"]) == 2
    assert f"cannot write in {tmp_path / 'file' / 'run'}: Not a directory" in capsys.readouterr().err


def test_a_run_dir_that_cannot_be_written_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    # issue 44: a read-only run directory ended in a raw OSError traceback on .lock. Root (CI) may write anywhere,
    # so the refusal is driven by the write probe failing as it fails for a user without permission.
    import tempfile

    def denied(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", dir)
    monkeypatch.setattr(tempfile, "TemporaryFile", denied)
    assert main([*TINY, "--run-dir", str(tmp_path / "ro"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write in {tmp_path / 'ro'}: Permission denied; give a --run-dir you can write to" in err, err
    assert "Traceback" not in err


def test_the_lock_file_is_removed_when_a_run_ends(tmp_path, capsys, one_thread):
    # issue 45.7: a .lock file stayed in the run directory
    assert main([*TINY, "--schedule", "1f1b", "--run-dir", str(tmp_path), "--steps", "1"]) == 0
    assert not (tmp_path / ".lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "history.json", "loss.png"]


def test_a_resume_with_another_dp_says_what_changes_and_needs_allow_dp_change(tmp_path, capsys, one_thread):
    # issue 44: a --dp 2 checkpoint resumed with --dp 1 halved the global batch without a word
    common = [*TINY, "--schedule", "1f1b", "--run-dir", str(tmp_path)]
    assert main([*common, "--steps", "1"]) == 0
    capsys.readouterr()
    no_emulate = [a for a in common if a != "--emulate"]
    assert main([*no_emulate, "--steps", "2", "--resume", "--dp", "2"]) == 2  # refused before any rank starts
    err = capsys.readouterr().err
    assert "was written with --dp 1: 1 x 4 micro-batches x 1 sequences = 4 sequences per window; this run asks " \
           "for --dp 2: 2 x 4 micro-batches x 1 sequences = 8 sequences per window. The global batch changes" in err
    assert "Resume with --dp 1, or accept the change with --allow-dp-change" in err, err
    from pipeoptim.cli.train import _check_dp_change
    saved, mine = {"dp": 2, "microbatches": 4, "microbatch_size": 1}, {"dp": 1, "microbatches": 4, "microbatch_size": 1}
    _check_dp_change("ckpt", saved, mine, allowed=True)  # accepted, and said
    assert "--allow-dp-change: ckpt was written with --dp 2" in capsys.readouterr().err
    _check_dp_change("ckpt", {"microbatches": 4}, mine, allowed=False)  # an older checkpoint: dp not recorded


def test_history_follows_every_checkpoint_and_a_run_ended_by_ctrl_c_leaves_the_newest_ones(tmp_path, capsys,
                                                                                         monkeypatch, one_thread):
    # issue 44.3: after SIGINT there was no history.json or loss.png; they are now written with every checkpoint
    # and, on the way out, from the newest committed checkpoint
    from pipeoptim.train import Pipeline
    real = Pipeline.train_step

    def step(self, batch):
        if self.step_count == 5:  # inside step 6, after the checkpoint of step 4
            raise KeyboardInterrupt
        return real(self, batch)
    monkeypatch.setattr(Pipeline, "train_step", step)
    rc = main([*TINY, "--schedule", "1f1b", "--run-dir", str(tmp_path), "--steps", "10", "--save-every", "4"])
    assert rc == 130, capsys.readouterr().err
    assert [r["step"] for r in _strict(tmp_path / "history.json")["history"]] == [1, 2, 3, 4]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert not (tmp_path / ".lock").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ---- issue 45.7: messages that name the cause ----------------------------------------------------------
def test_an_emulated_runs_idle_share_is_labelled_as_such(tmp_path, capsys, one_thread):
    # its "bubble" was a constant ~1 - 1/D (one process running the stages in turn), unlabelled
    rc = main([*TINY[:-1], "--schedule", "async-1f1b", "--steps", "2", "--run-dir", str(tmp_path)])  # progress bar on
    assert rc == 0
    captured = capsys.readouterr()
    assert "--emulate runs the 2 stages one after another in this process: the progress bar's 'idle'" in captured.err
    assert "idle=" in captured.err and "bubble=" not in captured.err
    assert "(--emulate: the stages run one after another, so it is not the schedule's bubble)" in captured.out


def _sparse_tokenizer(path):
    """A tokenizer.json whose two tokens have ids 0 and 500: its vocabulary size (2) says nothing of id 500."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "x": 500}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_a_token_id_beyond_the_vocabulary_is_named_before_anything_runs(tmp_path, capsys):
    # it ended in "IndexError: index out of range in self" naming the stage, not the cause
    pytest.importorskip("transformers")
    _sparse_tokenizer(tmp_path / "tokenizer.json")
    text = tmp_path / "corpus.txt"
    text.write_text("x " * 5000)
    assert main([*TINY[:-2], "--model", "hf-gpt2", "--data", str(text), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--steps", "1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "the text has token id 500, but the tokenizer's vocabulary size is 2 (ids 0 to 1)" in err, err
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_a_resume_after_the_tokenizers_files_changed_names_the_tokenizer(tmp_path, capsys, one_thread):
    # it ended in a 25-line traceback about an embedding shape that never mentioned the tokenizer
    text = tmp_path / "corpus.txt"
    text.write_bytes(_some_text())
    _local_tokenizer(tmp_path / "tok", text.read_bytes())
    common = ["--model", "hf-gpt2", "--stages", "2", "--schedule", "1f1b", "--microbatches", "2", "--microbatch-size",
              "2", "--emulate", "--no-progress", "--data", str(text), "--tokenizer", str(tmp_path / "tok"),
              "--run-dir", str(tmp_path / "run")]
    assert main([*common, "--steps", "1"]) == 0
    capsys.readouterr()
    shutil.rmtree(tmp_path / "tok")
    _local_tokenizer(tmp_path / "tok", text.read_bytes()[: len(text.read_bytes()) // 3])  # retrained: other merges
    assert main([*common, "--steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer {tmp_path / 'tok'} changed since {tmp_path / 'run' / 'checkpoint' / 'step-00000001'} " \
           "was written (its files' sha256" in err, err
    assert "one row per token id of the old tokenizer" in err and "Traceback" not in err


def test_outputs_come_from_the_newest_checkpoint_whose_meta_is_intact(tmp_path, capsys, one_thread):
    from pipeoptim.cli.train import outputs_from_checkpoint
    assert main([*TINY, "--schedule", "1f1b", "--run-dir", str(tmp_path), "--steps", "4", "--save-every", "2"]) == 0
    meta = tmp_path / "checkpoint" / "step-00000004" / "meta.pt"
    blob = bytearray(meta.read_bytes())
    blob[-20] ^= 0xFF  # the same size, other bytes: its hash no longer matches the manifest
    meta.write_bytes(bytes(blob))
    (tmp_path / "history.json").unlink()
    got = outputs_from_checkpoint(str(tmp_path), TrainConfig(model="tiny", stages=2, schedule="1f1b", policy="none",
                                                             optimizer="adamw"))
    assert got == str(tmp_path / "checkpoint" / "step-00000002")
    assert [r["step"] for r in _strict(tmp_path / "history.json")["history"]] == [1, 2]
    assert outputs_from_checkpoint(str(tmp_path / "none"), TrainConfig()) is None


def test_the_loss_picture_says_tokens_for_a_prepared_tokenized_folder(tmp_path, monkeypatch):
    # a prepared folder of a tokenizer's ids, trained without --tokenizer, was plotted in nats/byte
    pytest.importorskip("matplotlib")
    import pipeoptim.viz as viz
    from pipeoptim.cli.train import _write_outputs
    units = []
    monkeypatch.setattr(viz, "plot_training", lambda ax, history, unit, title: units.append(unit))
    cfg = TrainConfig(model="hf-gpt2", stages=2, schedule="1f1b", policy="none", optimizer="adamw")
    rows = [{"step": 1, "loss": 5.0, "val_loss": None}]
    _write_outputs(str(tmp_path), rows, cfg.replace(prepared={"tokenizer": "tok.json"}))
    _write_outputs(str(tmp_path), rows, cfg.replace(prepared={"tokenizer": "bytes"}))
    _write_outputs(str(tmp_path), rows, cfg)
    assert units == ["nats/token", "nats/byte", "nats/byte"]
