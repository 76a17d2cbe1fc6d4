"""torchvision ResNets as pipeline layers: ``[stem, residual block × n, pool + classifier]``.

    from torchvision.models import resnet18
    from pipeoptim.models.vision import resnet_layers, resnet_init
    layers = resnet_layers(resnet18(num_classes=10))                 # or built on meta, with init_fn=resnet_init
    pipe = Pipeline(layers, loss_fn=torch.nn.functional.cross_entropy, devices=4, schedule="async-1f1b",
                    policy="pipeoptim", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))

Every layer maps one tensor to one tensor, so any contiguous run is a stage. The layers hold the model's own
modules (no copy). BatchNorm's running statistics are buffers of the stage that holds them and travel in
checkpoints. ``resnet_init`` is torchvision's own initialisation scheme (written here), for meta-built
models: Kaiming-normal convolutions (fan-out), BatchNorm weight 1, bias 0 and fresh running statistics,
the classifier's default init, and ``zero_init_residual`` as torchvision's constructor takes it.
"""
from __future__ import annotations

from torch import nn

__all__ = ["resnet_layers", "resnet_init", "ResNetHead", "require_torchvision"]


def require_torchvision():
    try:
        import torchvision
    except ImportError:
        raise ImportError("torchvision models need the torchvision package: pip install 'pipeoptim[vision]'") from None
    return torchvision


class ResNetHead(nn.Module):
    """Global average pool, flatten, classifier."""

    def __init__(self, avgpool: nn.Module, fc: nn.Module):
        super().__init__()
        self.avgpool, self.fc = avgpool, fc

    def forward(self, x):
        return self.fc(self.avgpool(x).flatten(1))


def resnet_layers(model: nn.Module) -> list[nn.Module]:
    """Cut a torchvision ResNet (``resnet18`` ... ``resnet152``, ``resnext``, ``wide_resnet``) into layers."""
    needed = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")
    missing = [n for n in needed if not hasattr(model, n)]
    if missing:
        raise TypeError(f"resnet_layers expects a torchvision ResNet; {type(model).__name__} has no {missing}")
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    blocks = [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for block in stage]
    return [stem, *blocks, ResNetHead(model.avgpool, model.fc)]


def resnet_init(layer: nn.Module, zero_init_residual: bool = False) -> None:
    """torchvision's ResNet initialisation for one layer (``init_fn`` of a meta-built ResNet; for
    ``zero_init_residual=True`` pass ``functools.partial(resnet_init, zero_init_residual=True)``)."""
    for m in layer.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            m.reset_parameters()  # weight 1, bias 0 (and, for BatchNorm, fresh running statistics)
        elif isinstance(m, nn.Linear):
            m.reset_parameters()
    if zero_init_residual:
        for m in layer.modules():
            last = getattr(m, "bn3", None) if hasattr(m, "conv3") else getattr(m, "bn2", None)
            if isinstance(last, nn.BatchNorm2d) and hasattr(m, "downsample"):
                nn.init.zeros_(last.weight)

