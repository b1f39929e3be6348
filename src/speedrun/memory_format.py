"""The memory format a model trains in: channels_last wherever it is safe, else contiguous.

channels_last (NHWC) is what GPUs' Tensor Cores take, and oneDNN's CPU convolutions run faster in
it too (the default model's training step 1.2-1.3x on 2 AVX2 cores; docs/measurements.md). But
oneDNN's CPU backward pass of a strided 1x1 convolution in channels_last writes past its workspace
when the input has fewer channels than the kernel's block (oneDNN issue 6035: 16 channels for the
AVX-512 kernel, 8 for AVX2's), corrupting the heap ("double free or corruption", or a SIGSEGV
later). Such a model trains contiguous on the CPU; so does any model on a CPU whose kernels were
never checked. `--memory-format` overrides the choice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from speedrun.recipe import MEMORY_FORMATS

# Input channels per block of oneDNN's 1x1 backward-weights kernel, by torch's CPU capability
# (torch.backends.cpu.get_cpu_capability()); a capability not listed stays contiguous.
ONEDNN_BLOCK = {"AVX512": 16, "AVX2": 8}


@dataclass(frozen=True)
class MemoryFormat:
    """The layout chosen, why (one clause, for the run's header and results.json), and a warning
    when a user's choice overrides the guard against oneDNN's fault."""

    channels_last: bool
    why: str
    warning: str | None = None

    @property
    def name(self) -> str:
        return "channels_last" if self.channels_last else "contiguous"

    @property
    def torch_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


def thin_strided_1x1(model: nn.Module, block: int) -> nn.Conv2d | None:
    """The first strided 1x1 convolution of `model` with fewer than `block` input channels, if any."""
    for module in model.modules():
        if (isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and module.stride != (1, 1)
                and module.in_channels < block):
            return module
    return None


def choose_memory_format(model: nn.Module, device_type: str, requested: str = "auto",
                         isa: str | None = None) -> MemoryFormat:
    """The memory format `model` trains in on a `device_type` ("cpu", "cuda") device. `requested`:
    "auto" (see the module docstring), "channels_last" or "contiguous". `isa`: the CPU's capability
    as torch names it (default: this machine's)."""
    if requested not in MEMORY_FORMATS:
        raise ValueError(f"unknown memory format {requested!r}: one of {', '.join(MEMORY_FORMATS)}")
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return MemoryFormat(False, "no convolutions")
    auto, guarded = _auto(model, device_type, isa)
    if requested == "auto":
        return auto
    why = f"--memory-format {requested} asked for"
    if requested == "channels_last" and guarded:
        return MemoryFormat(True, why, f"--memory-format channels_last overrides the guard against {auto.why}")
    return MemoryFormat(requested == "channels_last", why)


def _auto(model: nn.Module, device_type: str, isa: str | None) -> tuple[MemoryFormat, bool]:
    """What "auto" picks for a model with convolutions, and whether the guard against oneDNN's
    fault is what made it contiguous."""
    if device_type != "cpu":
        return MemoryFormat(True, "a GPU's convolutions are fastest in it"), False
    isa = isa or torch.backends.cpu.get_cpu_capability()
    block = ONEDNN_BLOCK.get(isa)
    if block is None:
        return MemoryFormat(False, f"CPU capability {isa}: oneDNN's channels_last kernels for it are unchecked"), False
    conv = thin_strided_1x1(model, block)
    if conv is not None:
        return MemoryFormat(False, f"a strided 1x1 convolution with {conv.in_channels} input channels, under "
                                   f"{isa}'s block of {block}, whose channels_last backward corrupts the heap "
                                   "(oneDNN issue 6035)"), True
    return MemoryFormat(True, f"{isa}, no strided 1x1 convolution under {block} input channels"), False
