"""pipeoptim.models: layer lists that any contiguous cut turns into valid stages."""
import torch

from pipeoptim.models import GPTConfig, convnet_layers, gpt_layers
from pipeoptim.models.gpt import lm_loss


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_gpt_shapes_and_initial_loss():
    cfg = GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2)
    layers = gpt_layers(cfg)
    assert len(layers) == cfg.n_layers + 2
    idx = torch.randint(0, 256, (3, 16))
    logits = _run(layers, idx)
    assert logits.shape == (3, 16, 256)
    # near-uniform predictions at initialisation: loss close to ln(256)
    assert abs(lm_loss(logits, idx).item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_gpt_is_causal():
    cfg = GPTConfig(seq_len=8, d_model=16, n_heads=2, n_layers=1)
    layers = gpt_layers(cfg)
    idx = torch.randint(0, 256, (1, 8))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    a, b = _run(layers, idx), _run(layers, changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = gpt_layers(GPTConfig(d_model=16, n_heads=2, n_layers=1), seed=5)
    assert torch.equal(torch.rand(1), before), "building a model must not consume the global RNG"
    b = gpt_layers(GPTConfig(d_model=16, n_heads=2, n_layers=1), seed=5)
    for la, lb in zip(a, b):
        for pa, pb in zip(la.parameters(), lb.parameters()):
            assert torch.equal(pa, pb)


def test_convnet_logits():
    x = torch.rand(4, 1, 8, 8)
    assert _run(convnet_layers(), x).shape == (4, 10)
