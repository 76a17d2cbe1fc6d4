"""pipeoptim.recipes: a named recipe builds the Pipeline it describes, and `pipeoptim train --recipe` sets the flags
it names without overriding a flag the user gave."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from pipeoptim import recipes
from pipeoptim.cli.train import _optimizer, add_arguments, apply_recipe
from pipeoptim.job import TrainConfig
from pipeoptim.runtime.plan import ConfigError
from pipeoptim.train import Pipeline


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown recipe 'fast'; known: async-transformer"):
        recipes.get("fast")


def test_every_recipe_builds_its_pipeline_and_warms_the_lr_up(one_thread):
    for name in recipes.names():
        r = recipes.get(name)
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]
        lr = 0.01
        pipe = Pipeline(layers, loss_fn=nn.functional.mse_loss, devices=2, microbatches=4, emulate=True,
                        **r.pipeline_kwargs(lr=lr))
        assert (pipe.schedule.name, pipe.policy_name) == (r.schedule, r.policy)
        seen = []
        for _ in range(3):
            pipe.train_step((torch.randn(8, 6), torch.randn(8, 6)))
            st = pipe.workers[0].stages[next(iter(pipe.workers[0].stages))]
            group = st.optimizer.param_groups[0]
            seen.append(group["lr"])
        if r.optimizer == "muon":   # Muon on the 2-D weights (momentum β1), AdamW on the biases, one lr and decay
            kinds = {type(o).__name__: o.param_groups[0] for o in st.optimizer.children}
            assert set(kinds) == {"Muon", "AdamW"}
            assert kinds["Muon"]["momentum"] == r.beta1 and kinds["Muon"]["adjust_lr_fn"] == "match_rms_adamw"
            assert kinds["Muon"]["lr"] == kinds["AdamW"]["lr"] == group["lr"]
            assert kinds["Muon"]["weight_decay"] == kinds["AdamW"]["weight_decay"] == r.weight_decay
        else:
            assert type(st.optimizer).__name__ == {"adamw": "AdamW", "nadam": "NAdam"}[r.optimizer]
            assert group["betas"][0] == r.beta1 and group["weight_decay"] == r.weight_decay
        if "delta" in r.policy_options:
            assert st.policy.delta == r.policy_options["delta"]
        # linear warm-up: after u updates the lr is lr * min(1, (u + 1) / warmup), rising
        assert all(a < b for a, b in zip(seen, seen[1:])) and seen[-1] <= lr
        assert "lr_scheduler" not in r.pipeline_kwargs(lr=lr, lr_scheduler=False)
        with pytest.raises(ValueError, match="lr must be a positive number"):
            r.optimizer_factory(0.0)


def _args(*argv):
    p = add_arguments(argparse.ArgumentParser())
    return TrainConfig.from_args(p.parse_args(list(argv)))


def test_cli_recipe_sets_its_flags_and_refuses_a_contradicting_one():
    r = recipes.get("async-transformer")
    args = apply_recipe(_args("--recipe", "async-transformer"))
    assert (args.schedule, args.policy, args.optimizer, args.momentum, args.weight_decay) == \
        (r.schedule, r.policy, r.optimizer, r.beta1, r.weight_decay)
    same = apply_recipe(_args("--recipe", "async-transformer", "--schedule", r.schedule))  # agreeing is fine
    assert same.schedule == r.schedule
    with pytest.raises(ConfigError, match="--recipe async-transformer sets --schedule 2bw but you gave --schedule gpipe"):
        apply_recipe(_args("--recipe", "async-transformer", "--schedule", "gpipe"))
    with pytest.raises(ConfigError, match="sets --weight-decay"):
        apply_recipe(_args("--recipe", "async-transformer", "--weight-decay", "0"))
    plain = apply_recipe(_args())  # no recipe: nothing changes
    assert plain == _args() and plain.schedule == "async-1f1b" and plain.weight_decay is None


def test_cli_weight_decay_reaches_the_optimizer():
    w = [nn.Parameter(torch.zeros(2, 2))]
    for name in ("adamw", "nadam"):
        assert _optimizer(TrainConfig(optimizer=name, lr=1e-3))(w).param_groups[0]["weight_decay"] == 0.01
        assert _optimizer(TrainConfig(optimizer=name, lr=1e-3, weight_decay=0.1))(w).param_groups[0]["weight_decay"] == 0.1


def test_linear_warmup_refuses_a_length_that_is_no_whole_positive_number():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive whole number of updates"):
            recipes.linear_warmup(bad)


def test_cli_muon_scale_adamw_gives_both_optimizers_the_lr_and_weight_decay():
    """--muon-scale adamw: Muon's update at AdamW's RMS (torch's adjust_lr_fn='match_rms_adamw'), AdamW beside it
    at the same --lr, --weight-decay on both, and it is the default (weight decay 0.1); 'original' keeps torch's
    own scaling and AdamW at 1e-3."""
    from pipeoptim.optim import as_optimizer
    params = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(3))]
    made = _optimizer(TrainConfig(optimizer="muon", lr=2e-3, weight_decay=0.1, muon_scale="adamw"))(params)
    by_kind = {type(o).__name__: o.param_groups[0] for o in made}
    assert by_kind["Muon"]["adjust_lr_fn"] == "match_rms_adamw"
    assert by_kind["Muon"]["lr"] == by_kind["AdamW"]["lr"] == 2e-3
    assert by_kind["Muon"]["weight_decay"] == by_kind["AdamW"]["weight_decay"] == 0.1
    assert by_kind["Muon"]["momentum"] == 0.95
    default = {type(o).__name__: o.param_groups[0] for o in _optimizer(TrainConfig(optimizer="muon", lr=2e-3))(params)}
    assert default["Muon"]["adjust_lr_fn"] == "match_rms_adamw" and default["AdamW"]["lr"] == 2e-3
    assert default["Muon"]["weight_decay"] == default["AdamW"]["weight_decay"] == 0.1
    plain = {type(o).__name__: o.param_groups[0]
             for o in _optimizer(TrainConfig(optimizer="muon", lr=2e-3, muon_scale="original"))(params)}
    assert plain["Muon"]["adjust_lr_fn"] in (None, "original") and plain["AdamW"]["lr"] == 1e-3
    assert as_optimizer(made) is not None


def test_cli_muon_scale_needs_muon():
    from pipeoptim.cli.train import _check_prediction
    with pytest.raises(ConfigError, match="--muon-scale adamw sets how Muon scales its update, but the optimizer is "
                                          "adamw; use --optimizer muon or drop --muon-scale"):
        _check_prediction(TrainConfig(optimizer="adamw", policy="pipeoptim", muon_scale="adamw"))
    _check_prediction(TrainConfig(optimizer="muon", policy="pipeoptim", muon_scale="adamw",
                                  predict_from="last_update"))


def test_every_recipe_trains_from_the_cli(tmp_path, capsys, one_thread):
    """`pipeoptim train --recipe NAME` runs end to end with the flags the recipe sets (Muon's included)."""
    from pipeoptim.cli.train import main
    for name in recipes.names():
        rc = main(["--model", "tiny", "--stages", "2", "--microbatches", "4", "--microbatch-size", "1", "--emulate",
                   "--no-progress", "--recipe", name, "--lr", "1e-3", "--steps", "4",
                   "--run-dir", str(tmp_path / name)])
        assert rc == 0, capsys.readouterr().err
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert 0 < float(last.removeprefix("final loss: ")) < 6.0, (name, last)


def test_a_flag_given_at_its_default_value_still_contradicts_the_recipe():
    # issue 45.5: `--recipe async-transformer-muon --optimizer adamw` ran Muon and `--schedule async-1f1b` ran 2BW,
    # silently: the recipe compared each flag with its default, and these are the defaults
    with pytest.raises(ConfigError, match="--recipe async-transformer-muon sets --optimizer muon but you gave "
                                          "--optimizer adamw"):
        apply_recipe(_args("--recipe", "async-transformer-muon", "--optimizer", "adamw"))
    with pytest.raises(ConfigError, match="sets --schedule 2bw but you gave --schedule async-1f1b"):
        apply_recipe(_args("--recipe", "async-transformer-muon", "--schedule", "async-1f1b"))
    with pytest.raises(ConfigError, match="sets --muon-scale adamw but you gave --muon-scale original"):
        apply_recipe(_args("--recipe", "async-transformer-muon", "--muon-scale", "original"))
    args = apply_recipe(_args("--recipe", "async-transformer-muon", "--optimizer", "muon"))  # agreeing, given: fine
    assert args.optimizer == "muon" and args.muon_scale == "adamw"


def test_a_recipe_without_lr_takes_the_lr_it_was_measured_at_or_refuses_another_depth():
    # issue 45.5: `--recipe async-transformer-muon --model hf-llama` trained at 3e-3, never measured
    for name, stages, lr in [("async-transformer-muon", "4", 3.2e-2), ("async-transformer-muon", "8", 1.6e-2),
                             ("async-transformer", "16", 5e-4)]:
        args = apply_recipe(_args("--recipe", name, "--stages", stages))
        assert args.recipe_lr == lr
    with pytest.raises(ConfigError, match=r"--recipe async-transformer-muon without --lr: recipe "
                                          r"'async-transformer-muon' was measured on 4 devices at lr 0.032, 8 devices "
                                          r"at lr 0.016, 16 devices at lr 0.016, not on 2; give a learning rate"):
        apply_recipe(_args("--recipe", "async-transformer-muon", "--stages", "2"))
    given = apply_recipe(_args("--recipe", "async-transformer-muon", "--stages", "2", "--lr", "1e-2"))
    assert given.recipe_lr is None  # a given lr is the user's: any depth
    assert "measured on 4 devices at lr 0.032" in recipes.get("async-transformer-muon").describe()


def test_the_cli_runs_a_recipe_at_its_measured_lr(tmp_path, capsys, one_thread):
    from pipeoptim.cli.train import main
    rc = main(["--model", "tiny", "--stages", "4", "--microbatches", "4", "--microbatch-size", "1", "--emulate",
               "--no-progress", "--recipe", "async-transformer-muon", "--steps", "1", "--run-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "history.json").read_text())["config"]
    assert config["lr"] == 3.2e-2 and config["lr_given"] is False and config["optimizer"] == "muon"
