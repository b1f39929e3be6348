"""Models: build one by name, make any CNN size-agnostic, and initialise it as the record did.

Names resolve in this order: speedrun's own small models (`resnet-fmnist`, `resnet-fmnist-tiny`),
then torchvision's (`resnet50`, ...), then timm's (`timm/resnet50d`, or any name timm knows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from speedrun.errors import SpeedrunError


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al. 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, norm: type[nn.Module] = nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm1 = norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = norm(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          norm(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)), inplace=True)
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=True)


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with groups of 4 channels: statistics per image, so results do not depend on
    how a batch is split across devices."""
    return nn.GroupNorm(max(1, channels // 4), channels)


class SmallResNet(nn.Module):
    """A ResNet for small images (28 px Fashion-MNIST): a 3x3 stem at full resolution, then one
    stage per entry of `widths[1:]`, each halving the resolution. Global average pooling makes it
    take any input size, which progressive resizing needs."""

    def __init__(
        self,
        widths: tuple[int, ...],
        blocks_per_stage: int = 1,
        in_chans: int = 1,
        num_classes: int = 10,
        norm: type[nn.Module] = nn.BatchNorm2d,
    ):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_chans, widths[0], 3, 1, 1, bias=False), norm(widths[0]),
                                  nn.ReLU(inplace=True))
        stages = []
        for w_in, w_out in zip(widths[:-1], widths[1:]):
            blocks = [BasicBlock(w_in, w_out, stride=2, norm=norm)]
            blocks += [BasicBlock(w_out, w_out, norm=norm) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


# speedrun's own models: name -> constructor(in_chans, num_classes)
OWN_MODELS = {
    # 16 px wide at 28 x 28, then 32, 64, 128 at 14, 7, 4: the fourth stage adds about 1.3
    # points of Fashion-MNIST top-1 at 10 epochs over three stages (measured, docs/measurements.md).
    "resnet-fmnist": lambda in_chans, num_classes: SmallResNet((16, 32, 64, 128), 1, in_chans, num_classes),
    "resnet-fmnist-tiny": lambda in_chans, num_classes: SmallResNet((8, 16, 32), 1, in_chans, num_classes),
    "resnet-fmnist-tiny-gn": lambda in_chans, num_classes: SmallResNet((8, 16, 32), 1, in_chans, num_classes,
                                                                       group_norm),
}


def build_model(name: str, num_classes: int, in_chans: int = 3, zero_init: bool = True) -> nn.Module:
    """A freshly initialised classifier: `name` from speedrun, torchvision or timm (see module
    docstring), with `in_chans` input channels and `num_classes` outputs, made size-agnostic,
    with zero-initialised residual BatchNorms (unless `zero_init` is False) and an N(0, 0.01)
    final layer."""
    if name in OWN_MODELS:
        model = OWN_MODELS[name](in_chans, num_classes)
    elif not name.startswith("timm/") and name in torchvision.models.list_models(module=torchvision.models):
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
        if in_chans != 3:
            _replace_first_conv(model, in_chans)
        model = make_size_agnostic(model)
    else:
        import timm

        timm_name = name.removeprefix("timm/")
        if not timm.is_model(timm_name):
            raise SpeedrunError(
                f"unknown model {name!r}: not one of speedrun's ({', '.join(OWN_MODELS)}), "
                "torchvision's or timm's (try `python -c 'import timm; print(timm.list_models())'`)"
            )
        # timm zero-initialises its residual blocks itself (zero_init_last) where a model has them.
        options = {} if zero_init else {"zero_init_last": False}
        try:
            model = timm.create_model(timm_name, pretrained=False, num_classes=num_classes, in_chans=in_chans,
                                      **options)
        except TypeError:
            raise SpeedrunError(f"timm's {timm_name} has no zero_init_last option: keep zero_init=True") from None
    if zero_init:
        zero_init_residual_bn(model)
    init_classifier(model)
    return model


def _replace_first_conv(model: nn.Module, in_chans: int) -> None:
    """A new first convolution taking `in_chans` channels (torchvision's builders have no
    in_chans argument, which timm's models take and use instead)."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(
                    parent,
                    child_name,
                    nn.Conv2d(
                        in_chans,
                        child.out_channels,
                        child.kernel_size,
                        child.stride,
                        child.padding,
                        child.dilation,
                        child.groups,
                        child.bias is not None,
                    ),
                )
                return


_FIXED_POOLS = {nn.AvgPool2d: nn.AdaptiveAvgPool2d, nn.MaxPool2d: nn.AdaptiveMaxPool2d}


@torch.no_grad()
def make_size_agnostic(model: nn.Module, reference_size: int | tuple[int, int] = 224,
                       in_chans: int | None = None) -> nn.Module:
    """Make a CNN accept any input size by replacing the fixed pooling layer that feeds its
    classifier with adaptive pooling to the same output size. Modifies `model` in place and
    returns it.

    The 2018 code did this to ResNet's `AvgPool2d(7)` so that one model trains at 128, 224 and
    288 px. The pool is found by running one image of `reference_size` pixels (the size the model
    was designed for) through the model: it is the last pooling layer before the first linear
    layer, with no convolution in between, whose output holds exactly the linear layer's input
    features (1 x 1 for a global pool, 7 x 7 for VGG-style heads); the adaptive layer keeps
    producing that output size at every other size. Inner pools (a stem's max pool, DenseNet's
    transitions) keep scaling with the input, and models whose head pool is adaptive or
    functional (`x.mean`) are left unchanged.
    """
    height, width = (reference_size, reference_size) if isinstance(reference_size, int) else reference_size
    if in_chans is None:
        first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
        in_chans = first_conv.in_channels if first_conv is not None else 3
    calls: list[tuple[nn.Module, torch.Size]] = []  # pools, convolutions and linear layers, in call order
    watched = tuple(_FIXED_POOLS) + (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Conv2d, nn.Linear)
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: calls.append((mod, out.shape)))
        for m in model.modules()
        if isinstance(m, watched)
    ]
    was_training = model.training
    try:
        model.eval()
        model(torch.zeros(1, in_chans, height, width))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    first_linear = next((i for i, (m, _) in enumerate(calls) if isinstance(m, nn.Linear)), None)
    if first_linear is None or first_linear == 0:
        return model
    pool, shape = calls[first_linear - 1]
    adaptive = _FIXED_POOLS.get(type(pool))
    if adaptive is None or shape[1:].numel() != calls[first_linear][0].in_features:
        return model  # already adaptive, a convolution in between, or not what the classifier reads
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if child is pool:
                setattr(parent, child_name, adaptive(tuple(shape[-2:])))
    return model


def zero_init_residual_bn(model: nn.Module) -> int:
    """Zero the gamma of the last norm layer in every residual block, so each block starts as the
    identity (Goyal et al. 2017). Knows torchvision's and speedrun's blocks and timm's
    `zero_init_last`, in one place for all three families (torchvision's own
    `zero_init_residual` flag exists only on its ResNet builders). Returns the number of blocks
    initialised."""
    count = 0
    for m in model.modules():
        if isinstance(m, torchvision.models.resnet.Bottleneck) and m.bn3.weight is not None:
            nn.init.zeros_(m.bn3.weight)
        elif isinstance(m, torchvision.models.resnet.BasicBlock) and m.bn2.weight is not None:
            nn.init.zeros_(m.bn2.weight)
        elif isinstance(m, BasicBlock) and m.norm2.weight is not None:
            nn.init.zeros_(m.norm2.weight)
        elif hasattr(m, "zero_init_last") and callable(m.zero_init_last):
            m.zero_init_last()
        else:
            continue
        count += 1
    return count


def classifier_layer(model: nn.Module) -> nn.Linear | None:
    """The final fully connected layer: timm's `get_classifier()`, else the last nn.Linear."""
    if hasattr(model, "get_classifier"):
        head = model.get_classifier()
        if isinstance(head, nn.Linear):
            return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def init_classifier(model: nn.Module, std: float = 0.01) -> None:
    """Final layer weights ~ N(0, std), bias 0, as in the record's ResNet-50."""
    fc = classifier_layer(model)
    if fc is not None:
        nn.init.normal_(fc.weight, 0.0, std)
        if fc.bias is not None:
            nn.init.zeros_(fc.bias)
