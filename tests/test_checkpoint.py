"""Checkpoints: written atomically, off the training thread, from a copy of the state."""
import threading

import pytest
import torch

from speedrun import checkpoint


def test_background_writer_saves_the_state_as_it_was_when_asked(tmp_path, monkeypatch):
    # The write happens on another thread while training goes on and changes the weights in
    # place; the file must hold the values at the moment of the save (a copy), and a second save
    # waits for the first to be on disk.
    started, release = threading.Event(), threading.Event()
    real_save_atomic = checkpoint.save_atomic
    writers = []

    def slow_save_atomic(state, path):
        writers.append(threading.current_thread())
        started.set()
        assert release.wait(60)
        real_save_atomic(state, path)

    monkeypatch.setattr(checkpoint, "save_atomic", slow_save_atomic)
    weights = torch.zeros(4)
    momentum = {"state": {0: {"momentum_buffer": torch.zeros(4)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    writer = checkpoint.CheckpointWriter()
    writer.save({"model": {"w": weights}, "optimizer": momentum, "epoch": 1}, tmp_path / "checkpoint.pt")
    assert started.wait(60)
    weights.add_(1)  # the next training steps, while the file is being written
    momentum["state"][0]["momentum_buffer"].add_(1)
    momentum["param_groups"][0]["lr"] = 0.5
    assert writer.busy
    release.set()
    writer.wait()
    assert not writer.busy and writers[0] is not threading.current_thread()
    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    assert torch.equal(saved["model"]["w"], torch.zeros(4))
    assert torch.equal(saved["optimizer"]["state"][0]["momentum_buffer"], torch.zeros(4))
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.1 and saved["epoch"] == 1

    writer.save({"model": {"w": weights}, "epoch": 2}, tmp_path / "checkpoint.pt")
    writer.save({"model": {"w": weights * 2}, "epoch": 3}, tmp_path / "checkpoint.pt")  # waits for epoch 2's
    writer.wait()
    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    assert saved["epoch"] == 3 and torch.equal(saved["model"]["w"], torch.full((4,), 2.0))


def test_a_failed_background_write_is_reported_on_the_training_thread(tmp_path):
    writer = checkpoint.CheckpointWriter()
    (tmp_path / "file").write_text("not a folder")
    writer.save({"epoch": 1}, tmp_path / "file" / "checkpoint.pt")
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # reported once
