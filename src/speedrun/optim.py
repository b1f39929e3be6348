"""Optimizers: SGD with momentum (or LARS), and weight decay only where it helps.

Weight decay on normalisation scales and on biases hurts large-batch training (Jia et al. 2018;
Goyal et al. 2017 keep it on BN); the record run turned it off for BatchNorm weight and bias.
"""
from __future__ import annotations

import torch
from torch import nn

from speedrun.recipe import OptimizerSettings


def param_groups(model: nn.Module, weight_decay: float, no_decay: str = "norm_bias") -> list[dict]:
    """Split parameters into a decayed and an undecayed group.

    no_decay: "norm_bias" - every parameter of a normalisation layer and every bias is undecayed
                            (timm's param_groups_weight_decay: every 1-D parameter);
              "bn"        - only BatchNorm weight and bias (what the 2018 code did; conv and
                            linear biases keep their decay; timm has no such mode);
              "none"      - everything is decayed.
    """
    if no_decay == "norm_bias":
        # timm's rule and group order (param_groups_weight_decay), written out: importing timm
        # (its models, huggingface_hub) costs a training process about 0.8 CPU s at its start.
        undecayed, decay = [], []
        for name, param in model.named_parameters():
            if param.requires_grad:
                (undecayed if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
        return [{"params": undecayed, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
    if no_decay not in ("bn", "none"):
        raise ValueError(f"unknown no_decay mode {no_decay!r}")
    decay, undecayed = [], []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                skip = no_decay == "bn" and isinstance(module, nn.modules.batchnorm._BatchNorm)
                (undecayed if skip else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if undecayed:
        groups.append({"params": undecayed, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, settings: OptimizerSettings, lr: float,
                    fused: bool = False) -> torch.optim.Optimizer:
    """SGD with momentum, or LARS (timm's implementation), over `param_groups`. `fused`: SGD's
    update in one kernel per device and dtype rather than torch's default, a few multi-tensor
    kernels per step (LARS has no fused form).

    LARS adapts the step only of groups with weight decay, so norms and biases take plain SGD
    steps, as in You et al. 2017 and MLPerf's ResNet-50. (Not timm's create_optimizer_v2: its
    optimizer names fold Nesterov in, "sgd" meaning Nesterov, where a recipe states it apart.)
    """
    groups = param_groups(model, settings.weight_decay, settings.no_decay)
    if settings.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=settings.momentum, nesterov=settings.nesterov,
                               fused=fused or None)
    if settings.name == "lars":
        from timm.optim import Lars

        return Lars(groups, lr=lr, momentum=settings.momentum, nesterov=settings.nesterov)
    raise ValueError(f"unknown optimizer {settings.name!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
