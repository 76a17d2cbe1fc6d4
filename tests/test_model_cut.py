"""pipeoptim.stages.model_cut: the forms a model may take (layers, stage list, stage factory) and the errors for
models that cannot be cut, named by layer or stage with the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim.stages.model_cut import ModelCut, StageModule, as_layers
from pipeoptim.runtime.plan import ConfigError


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"hidden": x}


class ReturnsNone(nn.Module):
    def forward(self, x):
        return x, None


def test_only_a_sequence_of_modules_can_be_cut():
    with pytest.raises(ConfigError, match="a single Linear cannot be cut"):
        as_layers(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="layer 1 is a builtin_function_or_method, not an nn.Module"):
        as_layers([nn.Linear(2, 2), torch.relu])
    with pytest.raises(ConfigError, match="must be a list of modules"):
        as_layers(42)
    assert len(as_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))) == 2


def test_a_layer_must_return_tensors():
    stage = StageModule([nn.Identity(), ReturnsDict()], ["4", "5"])
    with pytest.raises(TypeError, match=r"layer 5 \(ReturnsDict\) returned dict"):
        stage(torch.zeros(2))
    stage = StageModule([ReturnsNone()], ["2"])
    with pytest.raises(TypeError, match=r"layer 2 \(ReturnsNone\) returned a tuple whose item 1 is NoneType"):
        stage(torch.zeros(2))


def test_a_tuple_feeds_the_next_layers_arguments():
    class Split(nn.Module):
        def forward(self, x):
            return [x, 2 * x]  # a list is a tuple of boundary tensors

    class Add(nn.Module):
        def forward(self, a, b):
            return a + b
    stage = StageModule([Split(), Add()])
    assert torch.equal(stage(torch.ones(2)), torch.full((2,), 3.0))
    assert stage.global_name("layers.1.weight") == "1.weight"


def test_factory_errors_name_the_stage():
    cut = ModelCut.from_stages(lambda i: [nn.Linear(2, 2)] * 4, 4, "1f1b", 4)
    with pytest.raises(ConfigError, match="returned 4 modules for stage 2"):
        cut.build(2, torch.device("cpu"), 0, None)
    cut = ModelCut.from_stages(lambda i: "stage", 4, "1f1b", 4)
    with pytest.raises(ConfigError, match="returned a str for stage 0"):
        cut.build(0, torch.device("cpu"), 0, None)
    cut = ModelCut.from_stages(lambda i: nn.Linear(2, 2), 2, "1f1b", 2)
    with pytest.raises(ConfigError, match=r"built stage 1 on \['cpu'\] but this rank runs on cuda:0"):
        cut._call_factory(1, torch.device("cuda", 0))


def test_a_wrong_number_of_stage_modules_is_refused():
    with pytest.raises(ConfigError, match="has 4 stages but 3 stage modules"):
        ModelCut.from_stages([nn.Linear(2, 2)] * 3, 4, "1f1b", 4)
    with pytest.raises(ConfigError, match="one module per stage"):
        ModelCut.from_stages(nn.Linear(2, 2), 4, "1f1b", 4)


def test_a_parameter_object_on_two_stages_is_refused():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    cut = ModelCut.from_layers([a, nn.ReLU(), b], [2, 1])
    with pytest.raises(ConfigError, match=r"parameter 2.weight is the same tensor as 0.weight .*tied="):
        cut.global_params()


def test_meta_factory_stages_give_shapes_without_memory():
    calls = []

    def factory(i):
        calls.append(i)
        return nn.Linear(4, 4)
    cut = ModelCut.from_stages(factory, 3, "1f1b", 3)
    assert cut.global_params(need_all=False) == {}
    shapes = cut.global_params(need_all=True)
    assert sorted(shapes) == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert all(p.is_meta for _, p in shapes.values()) and calls == [0, 1, 2]


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)

    def forward(self, x):
        return x * self.inv_freq.sum()


class Block(nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.linear, self.rotary = nn.Linear(4, 4), rotary

    def forward(self, x):
        return self.rotary(self.linear(x))


def test_a_module_shared_by_meta_built_layers_is_named_as_the_cause():
    from pipeoptim.train import Pipeline  # was: "layer 2 is partly on the meta device ... partly real"
    with torch.device("meta"):
        rotary = Rotary()
        layers = [nn.Linear(4, 4), Block(rotary), Block(rotary)]

    def init(layer):
        for m in layer.modules():
            if isinstance(m, Rotary):
                m.inv_freq.fill_(1.0)
            elif isinstance(m, nn.Linear):
                m.reset_parameters()
    with pytest.raises(ConfigError, match=r"layers 1 and 2 share one Rotary module \(1.rotary is 2.rotary\).*"
                                          r"copy.deepcopy"):
        Pipeline(layers, loss_fn=lambda y, t: ((y - t) ** 2).mean(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                 devices=2, schedule="1f1b", microbatches=2, emulate=True, init_fn=init)
