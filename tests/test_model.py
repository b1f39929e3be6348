"""Models: size-agnostic conversion, zero-init of residual BN, classifier init, the factory."""
import pytest
import torch
import torchvision
from torch import nn

from speedrun.errors import SpeedrunError
from speedrun.model import build_model, classifier_layer, make_size_agnostic, zero_init_residual_bn

SIZES = [(64, 64), (96, 96), (64, 112)]  # pixels (H, W); the last one non-square


REFERENCE = 64  # pixels: the size the fixed-pool models below are designed for


def old_style_resnet18() -> nn.Module:
    """torchvision's ResNet-18 with a fixed global average pool, as ResNets had in 2018
    (AvgPool2d(7) at 224 px; AvgPool2d(2) at this test's 64 px)."""
    model = torchvision.models.resnet18(num_classes=10)
    model.avgpool = nn.AvgPool2d(2)
    return model


def vgg_style_fixed_head() -> nn.Module:
    """A VGG-style net whose classifier expects exactly 4 x 4 features from a fixed max pool."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )


@pytest.mark.parametrize("factory, reference", [(old_style_resnet18, REFERENCE), (vgg_style_fixed_head, REFERENCE)])
def test_size_agnostic_conversion_runs_any_size(factory, reference):
    torch.manual_seed(0)
    model = factory().eval()
    with pytest.raises(RuntimeError):  # without the conversion, other sizes break the classifier
        model(torch.zeros(1, 3, 96, 112))
    reference_out = model(torch.randn(1, 3, reference, reference))
    make_size_agnostic(model, reference_size=reference)
    for h, w in SIZES:
        assert model(torch.randn(2, 3, h, w)).shape == (2, 10)
    # At the reference size the converted model computes exactly what the original did.
    torch.manual_seed(0)
    same = factory().eval()
    x = torch.randn(1, 3, reference, reference)
    assert torch.allclose(make_size_agnostic(same, reference)(x), factory_output(factory, x), atol=1e-5)
    assert reference_out.shape == (1, 10)


def factory_output(factory, x):
    torch.manual_seed(0)
    return factory().eval()(x)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "squeezenet1_1"])
def test_torchvision_models_from_the_factory_take_three_sizes(name):
    model = build_model(name, num_classes=7, in_chans=3).eval()
    with torch.no_grad():
        for h, w in SIZES:
            assert model(torch.randn(1, 3, h, w)).shape == (1, 7)


def test_factory_builds_own_timm_and_grayscale_models():
    assert build_model("resnet-fmnist", 10, 1)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert build_model("resnet18", 10, 1)(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    timm_model = build_model("timm/resnet10t", 5, 3)
    assert timm_model(torch.randn(1, 3, 48, 80)).shape == (1, 5)
    with pytest.raises(SpeedrunError, match="unknown model"):
        build_model("resnet-9000", 10)


def test_zero_init_of_last_bn_in_every_residual_block():
    model = torchvision.models.resnet50(num_classes=10)
    blocks = [m for m in model.modules() if isinstance(m, torchvision.models.resnet.Bottleneck)]
    assert all(b.bn3.weight.abs().sum() > 0 for b in blocks)
    assert zero_init_residual_bn(model) == len(blocks) == 16
    assert all(torch.count_nonzero(b.bn3.weight) == 0 for b in blocks)
    assert all(torch.count_nonzero(b.bn2.weight) > 0 for b in blocks)  # only the last BN

    own = build_model("resnet-fmnist", 10, 1)
    own_blocks = [m for m in own.modules() if type(m).__name__ == "BasicBlock"]
    assert own_blocks and all(torch.count_nonzero(b.norm2.weight) == 0 for b in own_blocks)
    # Each block starts with its residual branch adding nothing: out = relu(shortcut(x)).
    block = own_blocks[-1].eval()
    x = torch.randn(2, block.conv1.in_channels, 14, 14)
    with torch.no_grad():
        assert torch.equal(block(x), block.shortcut(x).relu())


def test_classifier_init_is_small_gaussian_with_zero_bias():
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=1000)
    fc = classifier_layer(model)
    assert fc is model.fc
    assert torch.count_nonzero(fc.bias) == 0
    assert fc.weight.std().item() == pytest.approx(0.01, rel=0.02)
    assert fc.weight.mean().abs().item() < 1e-3
