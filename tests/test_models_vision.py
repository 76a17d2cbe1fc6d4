"""torchvision ResNets through the pipeline (pipeoptim.models.vision): resnet18 cut into 4 stages computes the
unsplit model's loss, gradients and BatchNorm statistics (synchronous schedule), trains with SGD momentum under
async-1f1b with pipeoptim and stash, builds on meta with torchvision's initialisation, balances by time."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

torchvision = pytest.importorskip("torchvision")

import model_cases as mc  # noqa: E402
from pipeoptim.stages.materialize import initialize  # noqa: E402
from pipeoptim.models.vision import resnet_init, resnet_layers  # noqa: E402
from pipeoptim.train import Pipeline  # noqa: E402

N = 4


def images(step: int = 0, n: int = 8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def resnet(seed: int = 0, meta: bool = False):
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return torchvision.models.resnet18(num_classes=10)
    return torchvision.models.resnet18(num_classes=10)


def test_resnet18_four_stages_match_the_unsplit_model(one_thread):
    model = resnet()
    reference = copy.deepcopy(model)
    layers = resnet_layers(model)
    assert len(layers) == 10
    rec = mc.GradRecorder()
    pipe = Pipeline(layers, loss_fn=F.cross_entropy, optimizer=rec, devices=4, schedule="1f1b", microbatches=N,
                    emulate=True)
    x, y = images()
    loss = pipe.train_step((x, y))
    want_loss, want = mc.reference_grads(reference, lambda m, mb: F.cross_entropy(m(mb[0]), mb[1]),
                                         list(zip(x.chunk(N), y.chunk(N))))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = {g: by_id[id(p)] for g, p in pipe.named_parameters().items()}
    mc.assert_grads_match(rec.by_name(pipe), want, names, rtol=1e-4, atol=1e-5)
    # BatchNorm running statistics: each stage updated its own, as the unsplit model did micro-batch by micro-batch
    for (n, b), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, ref, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("policy", ["pipeoptim", "stash"])
def test_async_1f1b_trains_resnet18_with_sgd_momentum(policy, one_thread):
    from pipeoptim.data import digits
    (xtr, ytr), _ = digits()
    xtr = xtr.expand(-1, 3, -1, -1)
    xtr = (xtr - xtr.mean()) / xtr.std()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10, zero_init_residual=True)
    pipe = Pipeline(resnet_layers(model), loss_fn=F.cross_entropy, devices=4, schedule="async-1f1b", policy=policy,
                    microbatches=4, emulate=True, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(12):
        idx = torch.randint(0, len(ytr), (32,), generator=g)
        losses.append(pipe.train_step((xtr[idx], ytr[idx])))
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:2]) / 2, losses


def test_meta_built_resnet_equals_the_normal_build_initialised_the_same_way(one_thread):
    pipe = Pipeline(resnet_layers(resnet(meta=True)), loss_fn=F.cross_entropy, optimizer=mc.GradRecorder(), devices=4,
                    schedule="1f1b", microbatches=N, emulate=True, init_fn=resnet_init, seed=3)
    layers = resnet_layers(resnet(seed=99))
    for i, layer in enumerate(layers):
        initialize(layer, str(i), 3, resnet_init)
    normal = {f"{i}.{n}": t for i, layer in enumerate(layers) for n, t in
              list(layer.named_parameters()) + list(layer.named_buffers())}
    got = dict(pipe.named_parameters())
    for w in pipe.workers:
        for st in w.stages.values():
            got.update({st.module.global_name(n): b for n, b in st.module.named_buffers()})
    assert got.keys() == normal.keys()
    for k, v in normal.items():
        assert torch.equal(got[k], v), k
    conv = got["0.0.weight"]  # torchvision's scheme: Kaiming normal, fan-out, ReLU gain
    fan_out = conv.shape[0] * conv.shape[2] * conv.shape[3]
    assert float(conv.detach().std()) == pytest.approx((2 / fan_out) ** 0.5, rel=0.1)


def test_balance_by_time_on_resnet_layers(one_thread):
    pipe = Pipeline(resnet_layers(resnet()), loss_fn=F.cross_entropy, optimizer=mc.GradRecorder(), devices=4,
                    schedule="1f1b", microbatches=N, emulate=True, balance="time", sample=images()[0][:2])
    assert len(pipe.balance) == 4 and sum(pipe.balance) == 10
    assert pipe.train_step(images()) > 0


def test_not_a_resnet_is_a_clear_error():
    with pytest.raises(TypeError, match="expects a torchvision ResNet"):
        resnet_layers(torch.nn.Linear(2, 2))
