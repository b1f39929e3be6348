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


@pytest.mark.parametrize("factory", [old_style_resnet18, vgg_style_fixed_head])
def test_size_agnostic_conversion_runs_any_size(factory):
    torch.manual_seed(0)
    model = factory().eval()
    with pytest.raises(RuntimeError):  # without the conversion, other sizes break the classifier
        model(torch.zeros(1, 3, 96, 112))
    x = torch.randn(2, 3, REFERENCE, REFERENCE)
    with torch.no_grad():
        before = model(x)
        make_size_agnostic(model, reference_size=REFERENCE)
        # At the reference size the converted model computes exactly what the original did.
        assert torch.allclose(model(x), before, atol=1e-6)
        for h, w in SIZES:
            assert model(torch.randn(2, 3, h, w)).shape == (2, 10)


def pools(model: nn.Module) -> dict[str, type]:
    pool_types = (nn.AvgPool2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
    return {name: type(m) for name, m in model.named_modules() if isinstance(m, pool_types)}


# name -> the pool that feeds its classifier and must become adaptive (None: none must change).
# The pinned fixed pools are what the classifier sees; inner pools (a stem's max pool, DenseNet's
# transitions) must keep scaling with the input.
POOL_FEEDING_THE_HEAD = {
    "old-resnet18": "avgpool",
    "vgg-style": "5",
    "shufflenet_v2_x0_5": None,  # the head pool is functional (x.mean); the stem's max pool is inner
    "densenet121": None,  # the head pool is functional; transition3.pool is inner
    "resnet18": None,  # already adaptive
}


def model_by_name(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "old-resnet18":
        return old_style_resnet18()
    if name == "vgg-style":
        return vgg_style_fixed_head()
    return torchvision.models.get_model(name, weights=None, num_classes=10)


@pytest.mark.parametrize("name", list(POOL_FEEDING_THE_HEAD))
def test_only_the_pool_feeding_the_classifier_becomes_adaptive(name):
    original = model_by_name(name).eval()
    converted = make_size_agnostic(model_by_name(name).eval(), reference_size=REFERENCE if "-" in name else 224)
    before, after = pools(original), pools(converted)
    changed = {k for k in before if before[k] is not after[k]}
    expected = POOL_FEEDING_THE_HEAD[name]
    assert changed == ({expected} if expected else set()), (changed, after)
    if expected is None:  # nothing pinned: the same numbers at every size
        with torch.no_grad():
            for size in (128, 288):
                x = torch.randn(1, 3, size, size)
                out = converted(x)
                assert out.shape == (1, 10) and torch.equal(out, original(x)), size


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
