"""Parameter groups and optimizers."""
import pytest
import torch
from torch import nn

from speedrun.optim import build_optimizer, param_groups
from speedrun.recipe import OptimizerSettings


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=True)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 2)


def ids(params):
    return {id(p) for p in params}


def decayed_and_not(model, mode):
    groups = param_groups(model, 1e-4, mode)
    decayed = [g for g in groups if g["weight_decay"] > 0]
    undecayed = [g for g in groups if g["weight_decay"] == 0]
    return (ids(decayed[0]["params"]) if decayed else set(), ids(undecayed[0]["params"]) if undecayed else set())


def test_norm_bias_mode_decays_only_conv_and_linear_weights():
    m = Mixed()
    decayed, undecayed = decayed_and_not(m, "norm_bias")
    assert decayed == ids([m.conv.weight, m.fc.weight])
    assert undecayed == ids([m.conv.bias, m.bn.weight, m.bn.bias, m.gn.weight, m.gn.bias, m.ln.weight, m.ln.bias,
                             m.fc.bias])


def test_norm_bias_mode_makes_timms_groups_in_timms_order():
    # The rule is timm's param_groups_weight_decay, written out so that training imports no timm;
    # the order matters too: a checkpoint's optimizer state is kept per group.
    from timm.optim import param_groups_weight_decay

    from speedrun.model import build_model

    for model in (Mixed(), build_model("timm/vit_tiny_patch16_224", 10), build_model("resnet18", 10)):
        ours, timms = param_groups(model, 1e-4, "norm_bias"), param_groups_weight_decay(model, 1e-4)
        assert [(ids(g["params"]), g["weight_decay"]) for g in ours] == [
            (ids(g["params"]), g["weight_decay"]) for g in timms]


def test_original_mode_exempts_batchnorm_only():
    m = Mixed()
    decayed, undecayed = decayed_and_not(m, "bn")
    assert undecayed == ids([m.bn.weight, m.bn.bias])
    assert ids([m.conv.bias, m.fc.bias, m.gn.weight, m.ln.bias]) <= decayed


def test_none_mode_and_every_parameter_in_exactly_one_group():
    m = Mixed()
    decayed, undecayed = decayed_and_not(m, "none")
    assert undecayed == set() and decayed == ids(m.parameters())
    for mode in ("norm_bias", "bn"):
        d, u = decayed_and_not(m, mode)
        assert d.isdisjoint(u) and d | u == ids(m.parameters())


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_optimizers_step_and_leave_undecayed_params_alone_without_grad(name):
    torch.manual_seed(0)
    m = Mixed()
    opt = build_optimizer(m, OptimizerSettings(name=name, weight_decay=0.1, nesterov=True), lr=0.1)
    bn_before = m.bn.weight.detach().clone()
    conv_before = m.conv.weight.detach().clone()
    # Zero gradients everywhere: only weight decay can move a parameter.
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(m.bn.weight, bn_before)
    assert not torch.equal(m.conv.weight, conv_before)
    assert type(opt).__name__ == {"sgd": "SGD", "lars": "Lars"}[name]


def test_lars_scales_each_decayed_layer_by_its_trust_ratio_and_leaves_norms_to_sgd():
    # Real gradients, so the trust ratio eta * |w| / (|g| + wd * |w|) is far from 1 (You et al.
    # 2017): a decayed weight moves by lr * ratio * (g + wd * w); BatchNorm (undecayed) by lr * g.
    torch.manual_seed(0)
    m = Mixed()
    wd, lr, eta = 1e-4, 0.5, 0.001
    opt = build_optimizer(m, OptimizerSettings(name="lars", momentum=0.9, weight_decay=wd, nesterov=False), lr=lr)
    x = torch.randn(2, 3, 6, 6)
    out = m.fc(m.ln(m.gn(m.bn(m.conv(x))).mean((2, 3))))
    out.square().sum().backward()
    w, g = m.conv.weight.detach().clone(), m.conv.weight.grad.clone()
    bn_w, bn_g = m.bn.weight.detach().clone(), m.bn.weight.grad.clone()
    opt.step()
    ratio = eta * w.norm() / (g.norm() + wd * w.norm())
    assert not 0.5 < ratio < 2  # a real adaptation, not plain SGD
    assert torch.allclose(m.conv.weight, w - lr * ratio * (g + wd * w), atol=1e-7)
    assert torch.allclose(m.bn.weight, bn_w - lr * bn_g, atol=1e-7)


def test_fused_sgd_takes_the_same_steps_as_the_default():
    # The trainer uses the fused update on GPUs; it must be the same optimizer, only faster.
    models = []
    for fused in (False, True):
        torch.manual_seed(0)
        m = Mixed()
        opt = build_optimizer(m, OptimizerSettings(name="sgd", momentum=0.9, weight_decay=1e-3, nesterov=True),
                              lr=0.1, fused=fused)
        assert opt.defaults["fused"] is (True if fused else None)
        for step in range(3):
            torch.manual_seed(step)
            opt.zero_grad()
            m.fc(m.ln(m.gn(m.bn(m.conv(torch.randn(2, 3, 6, 6)))).mean((2, 3)))).square().sum().backward()
            opt.step()
        models.append(m)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a, b, atol=1e-6)
