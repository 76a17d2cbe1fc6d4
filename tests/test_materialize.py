"""pipeoptim.stages.materialize: meta layers made real and initialised from (seed, layer name) — the same bits as
building the layer normally under that seed; shared parameters stay shared; uninitialisable modules and
init_fns that leave tensors on meta are errors naming them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim.stages.materialize import (clone_structure, initialize, is_meta, layer_seed, materialize, replicate)
from pipeoptim.runtime.plan import ConfigError


def make_layer():
    return nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Sequential(nn.Linear(6, 5), nn.ReLU()),
                         nn.Conv1d(5, 3, 2), nn.BatchNorm1d(3))


def test_layer_seed_is_stable_and_distinct():
    assert layer_seed(0, "3") == layer_seed(0, "3")
    assert len({layer_seed(s, n) for s in range(3) for n in ("0", "1", "10", "1.0")}) == 12
    assert 0 <= layer_seed(2**40, "x") < 2**63


def test_meta_layer_equals_the_layer_built_normally_under_its_seed():
    torch.manual_seed(layer_seed(5, "7"))
    normal = make_layer()  # torch modules initialise in their constructors with reset_parameters()
    with torch.device("meta"):
        meta = make_layer()
    assert is_meta(meta)
    real = materialize(meta, "7", torch.device("cpu"), 5)
    got = dict(real.named_parameters()) | dict(real.named_buffers())
    want = dict(normal.named_parameters()) | dict(normal.named_buffers())
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    other = materialize(clone_structure(normal), "8", torch.device("cpu"), 5)
    assert not torch.equal(other[0].weight, real[0].weight)  # another layer name, other values


def test_initialize_leaves_the_callers_random_stream_alone():
    layer = make_layer()
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    initialize(layer, "0", 0)
    assert torch.equal(torch.rand(3), expected)


def test_parameters_shared_inside_a_layer_stay_shared():
    with torch.device("meta"):
        layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    layer[1].weight = layer[0].weight
    materialize(layer, "0", torch.device("cpu"), 0)
    assert layer[1].weight is layer[0].weight and not layer[0].weight.is_meta


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w


def test_a_module_without_reset_parameters_needs_an_init_fn():
    with torch.device("meta"):
        layer = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ConfigError, match=r"submodule '1' \(Scale\).*init_fn"):
        materialize(layer, "2", torch.device("cpu"), 0)
    with torch.device("meta"):
        layer = nn.Sequential(nn.Linear(3, 3), Scale())

    def init(m):
        m[0].reset_parameters()
        nn.init.ones_(m[1].w)
    materialize(layer, "2", torch.device("cpu"), 0, init)
    assert torch.equal(layer[1].w, torch.ones(3))


def test_an_init_fn_that_leaves_a_tensor_on_meta_is_named():
    with torch.device("meta"):
        layer = nn.Sequential(nn.Linear(3, 3))

    def bad(m):
        m[0].weight = nn.Parameter(torch.empty(3, 3, device="meta"))
        nn.init.zeros_(m[0].bias)
    with pytest.raises(ConfigError, match=r"layer 4: tensor '0.weight' is still on the meta device"):
        materialize(layer, "4", torch.device("cpu"), 0, bad)


def test_a_layer_partly_on_meta_is_refused():
    layer = nn.Sequential(nn.Linear(2, 2))
    with torch.device("meta"):
        layer.append(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="partly on the meta device"):
        is_meta(layer, "3")


def test_clone_structure_allocates_nothing_and_replicate_copies_values():
    layer = make_layer()
    clone = clone_structure(layer)
    assert all(t.is_meta for t in list(clone.parameters()) + list(clone.buffers()))
    assert clone[0].weight.requires_grad and isinstance(clone[0].weight, nn.Parameter)
    copy = replicate(layer, torch.device("cpu"))
    for (n, a), (_, b) in zip(layer.state_dict().items(), copy.state_dict().items()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), n
