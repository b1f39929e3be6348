"""The memory format a model trains in (speedrun.memory_format): channels_last wherever oneDNN's
strided 1x1 backward cannot corrupt the heap, contiguous where it can, and what a user asks for."""
import dataclasses
import json

import pytest
import torch
from cli_run import speedrun_here
from torch import nn

from speedrun import engine
from speedrun.config import TrainConfig
from speedrun.memory_format import ONEDNN_BLOCK, choose_memory_format, thin_strided_1x1
from speedrun.model import build_model
from speedrun.recipes import BUILTIN

TINY = build_model("resnet-fmnist-tiny", 10, 1)  # its first downsample: a strided 1x1 convolution of 8 channels
DEFAULT = build_model("resnet-fmnist", 10, 1)  # its thinnest strided 1x1 convolution: 16 channels


def test_a_model_with_a_strided_1x1_convolution_under_the_kernels_block_stays_contiguous():
    # AVX-512's kernel takes input channels in blocks of 16, AVX2's in blocks of 8: under it, the crash.
    chosen = choose_memory_format(TINY, "cpu", isa="AVX512")
    assert not chosen.channels_last and chosen.name == "contiguous"
    assert "8 input channels" in chosen.why and "16" in chosen.why and "oneDNN" in chosen.why
    assert chosen.warning is None
    conv = thin_strided_1x1(TINY, 16)
    assert conv.in_channels == 8 and conv.stride == (2, 2) and conv.kernel_size == (1, 1)


@pytest.mark.parametrize("model, isa", [(TINY, "AVX2"), (DEFAULT, "AVX2"), (DEFAULT, "AVX512")])
def test_a_model_whose_strided_1x1_convolutions_fill_the_block_trains_channels_last(model, isa):
    chosen = choose_memory_format(model, "cpu", isa=isa)
    assert chosen.channels_last and chosen.name == "channels_last", chosen.why
    assert isa in chosen.why and chosen.warning is None


def test_in_doubt_the_cpu_stays_contiguous():
    # A CPU capability whose oneDNN kernels were never checked (no AVX2, or another architecture).
    for isa in ("DEFAULT", "NO AVX", "SVE256", "VSX"):
        chosen = choose_memory_format(DEFAULT, "cpu", isa=isa)
        assert not chosen.channels_last and isa in chosen.why


def test_a_model_without_convolutions_is_left_as_it_is_and_a_gpu_takes_channels_last():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    assert not choose_memory_format(mlp, "cpu", isa="AVX2").channels_last
    assert not choose_memory_format(mlp, "cuda").channels_last
    assert choose_memory_format(TINY, "cuda").channels_last  # the kernels in question are the CPU's


def test_asking_overrides_the_choice_and_overriding_the_guard_warns():
    forced = choose_memory_format(TINY, "cpu", "channels_last", isa="AVX512")
    assert forced.channels_last and "asked for" in forced.why
    assert "--memory-format channels_last" in forced.warning and "8 input channels" in forced.warning
    assert choose_memory_format(TINY, "cpu", "channels_last", isa="AVX2").warning is None  # nothing refused
    plain = choose_memory_format(DEFAULT, "cpu", "contiguous", isa="AVX2")
    assert not plain.channels_last and plain.warning is None
    with pytest.raises(ValueError, match="nhwc"):
        choose_memory_format(TINY, "cpu", "nhwc")


def test_this_machines_choice_reads_torchs_cpu_capability():
    isa = torch.backends.cpu.get_cpu_capability()
    assert choose_memory_format(TINY, "cpu") == choose_memory_format(TINY, "cpu", isa=isa)


def test_train_refuses_an_unknown_memory_format():
    proc = speedrun_here("train", "--recipe", "tiny", "--memory-format", "nhwc")
    assert proc.returncode == 2  # argparse's usage, then its one error line, as for every bad choice
    assert "argument --memory-format: invalid choice: 'nhwc'" in proc.stderr.splitlines()[-1]


@pytest.mark.slow
def test_a_runs_results_say_which_format_and_why(tiny_one_epoch_run):
    # The run `speedrun train --recipe tiny --epochs 1` made (conftest.py), on this machine.
    chosen = choose_memory_format(TINY, "cpu")
    results = json.loads((tiny_one_epoch_run / "results.json").read_text())
    assert (results["memory_format"], results["memory_format_why"]) == (chosen.name, chosen.why)
    saved = torch.load(tiny_one_epoch_run / "checkpoint.pt", weights_only=False)
    assert saved["model"]["stem.0.weight"].is_contiguous(memory_format=chosen.torch_format)


@pytest.mark.slow
def test_an_override_of_the_guard_trains_in_the_format_asked_for_and_warns(tmp_path, monkeypatch, capsys):
    # The default model's thinnest strided 1x1 convolution has 16 channels, which every checked
    # kernel takes; a guard told this CPU's block is 32 refuses it, and the run is safe either way.
    monkeypatch.setitem(ONEDNN_BLOCK, torch.backends.cpu.get_cpu_capability(), 32)
    recipe = dataclasses.replace(BUILTIN["tiny"].with_epochs(1), model="resnet-fmnist", train_examples=256,
                                 val_examples=100)
    results = engine.train(TrainConfig(recipe=recipe, out=tmp_path / "run", device="cpu",
                                       memory_format="channels_last"))
    out, err = capsys.readouterr()
    assert results["memory_format"] == "channels_last" and "asked for" in results["memory_format_why"]
    assert ("warning: --memory-format channels_last overrides the guard against a strided 1x1 convolution with 16 "
            "input channels") in err
    assert "channels_last (--memory-format channels_last asked for)" in out.splitlines()[0]
    auto = engine.train(TrainConfig(recipe=recipe, out=tmp_path / "auto", device="cpu"))
    assert auto["memory_format"] == "contiguous" and "oneDNN issue 6035" in auto["memory_format_why"]
