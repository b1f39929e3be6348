"""`speedrun data prepare`: resized copies, never upscaled, resumable; the trainer finds them."""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from speedrun.cli import main
from speedrun.data import prepare as prepare_mod
from speedrun.data.base import Shard
from speedrun.data.imagefolder import ImageFolderSource
from speedrun.data.prepare import prepare
from speedrun.recipe import Phase
from cli_run import wait_for
from test_data_helpers import make_tree


def _sizes(root):
    out = {}
    for p in sorted(root.rglob("*.JPEG")):
        with Image.open(p) as img:
            out[str(p.relative_to(root))] = img.size
    return out


@pytest.mark.slow
def test_shorter_side_resized_aspect_kept_never_upscaled(tmp_path):
    src = make_tree(tmp_path / "d", classes=2, train_per_class=3, val_per_class=1,
                    sizes=[(300, 200), (100, 250), (60, 40)])
    s = prepare(src, tmp_path / "sz", [80, 150], workers=1, progress=False)
    original = _sizes(src)
    for n in (80, 150):
        copy = _sizes(tmp_path / "sz" / str(n))
        assert copy.keys() == original.keys()
        for rel, (w, h) in original.items():
            cw, ch = copy[rel]
            if min(w, h) <= n:
                # Never upscaled: the very same bytes.
                assert (tmp_path / "sz" / str(n) / rel).read_bytes() == (src / rel).read_bytes()
            else:
                assert min(cw, ch) == n
                assert abs(cw / ch - w / h) < 0.02
    assert s.images == 8 and s.bad == [] and s.resized + s.copied == 16 and s.skipped == 0


@pytest.mark.slow
def test_quality_option_changes_the_output(tmp_path):
    src = make_tree(tmp_path / "d", classes=1, train_per_class=2, val_per_class=1, sizes=[(300, 200)])
    prepare(src, tmp_path / "lo", [100], quality=20, workers=1, progress=False)
    prepare(src, tmp_path / "hi", [100], quality=95, workers=1, progress=False)
    lo = sum(p.stat().st_size for p in (tmp_path / "lo").rglob("*.JPEG"))
    hi = sum(p.stat().st_size for p in (tmp_path / "hi").rglob("*.JPEG"))
    assert lo < hi


@pytest.mark.slow
def test_resume_skips_finished_files_and_redoes_missing_ones(tmp_path, monkeypatch):
    src = make_tree(tmp_path / "d", classes=2, train_per_class=3, val_per_class=1, sizes=[(200, 150)])
    dst = tmp_path / "sz"
    prepare(src, dst, [64], workers=1, progress=False)
    done = dst / "64/train/c00/img001.JPEG"
    gone = dst / "64/train/c01/img000.JPEG"
    stamp = done.stat().st_mtime_ns
    gone.unlink()
    # A leftover temporary file from a killed run is not a finished output, and is removed.
    ended = subprocess.Popen(["true"])
    ended.wait()  # a process that has ended: its pid is no one's
    killed = dst / f".partial-{ended.pid}"
    killed.mkdir()
    (killed / "img000.JPEG").write_bytes(b"partial")
    s = prepare(src, dst, [64], workers=1, progress=False)
    assert (s.resized, s.skipped) == (1, 7)
    assert gone.is_file() and done.stat().st_mtime_ns == stamp
    assert not killed.exists()


def test_interrupted_write_leaves_no_finished_looking_file(tmp_path, monkeypatch):
    src = make_tree(tmp_path / "d", classes=1, train_per_class=1, val_per_class=1, sizes=[(200, 150)])

    def boom(self, fp, *a, **k):
        with open(fp, "wb") as f:  # half a file, then the user presses Ctrl-C
            f.write(b"\xff\xd8 partial")
        raise KeyboardInterrupt

    task = prepare_mod._Task(str(src / "train/c00/img000.JPEG"), "train/c00/img000.JPEG",
                             ((64, str(tmp_path / "out.JPEG")),), 90, str(tmp_path / ".partial"))
    monkeypatch.setattr(Image.Image, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare_mod.resize_one(task)
    assert list(tmp_path.glob("out.JPEG*")) == [] and list(tmp_path.glob(".partial-*/*")) == []


@pytest.mark.slow
def test_trainer_reads_the_copy_named_by_the_phase_and_falls_back_once(tmp_path, caplog):
    src = make_tree(tmp_path / "imagenet", classes=2, train_per_class=4, val_per_class=2, sizes=[(300, 200)])
    prepare(src, tmp_path / "imagenet-sz", [64], workers=1, progress=False)  # the default place
    source = ImageFolderSource(src, workers=0)
    stream = source.train_stream(Phase(0, 1, size=32, batch_size=4, lr=0.1, copy=64), Shard(), 0)
    assert str(stream._dataloader.dataset.root) == str(tmp_path / "imagenet-sz" / "64")
    assert len(list(stream)) == 2
    with caplog.at_level(logging.WARNING, logger="speedrun.data"):
        for _ in range(2):
            stream = source.train_stream(Phase(0, 1, size=32, batch_size=4, lr=0.1, copy=160), Shard(), 0)
            assert stream._dataloader.dataset.root == src
    assert caplog.text.count("no 160 px copy") == 1


@pytest.mark.slow
def test_copies_dir_from_environment(tmp_path, monkeypatch):
    src = make_tree(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1, sizes=[(300, 200)])
    prepare(src, tmp_path / "elsewhere", [64], workers=1, progress=False)
    monkeypatch.setenv("SPEEDRUN_COPIES", str(tmp_path / "elsewhere"))
    source = ImageFolderSource(src, workers=0)
    stream = source.train_stream(Phase(0, 1, size=32, batch_size=2, lr=0.1, copy=64), Shard(), 0)
    assert str(stream._dataloader.dataset.root) == str(tmp_path / "elsewhere" / "64")
    # Validation reads the copy it is told to (the evaluated phase's): mark the copy's validation
    # images (solid white), so that reading the full-size tree instead shows.
    for path in (tmp_path / "elsewhere" / "64" / "val").rglob("*.JPEG"):
        Image.new("RGB", Image.open(path).size, (255, 255, 255)).save(path, "JPEG")
    (images, _), = list(source.val_batches(32, 8, False, Shard(), copy=64))
    assert images.shape == (2, 3, 32, 32)
    assert images.min() >= 250
    (full, _), = list(source.val_batches(32, 8, False, Shard()))
    assert full.min() < 250


@pytest.mark.slow
def test_cli_prepare(tmp_path, capsys):
    src = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1, sizes=[(200, 150)])
    assert main(["data", "prepare", str(src), str(tmp_path / "sz"), "--sizes", "64", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "prepared 6 images" in out and "images/s per core" in out


def test_cli_prepare_errors(tmp_path, capsys):
    # Refused before any work starts: in the unit tier (prepare itself starts worker processes).
    src = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1, sizes=[(200, 150)])
    assert main(["data", "prepare", str(tmp_path / "nope"), str(tmp_path / "sz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["data", "prepare", str(src), str(tmp_path / "sz"), "--quality", "0"]) == 2
    assert main(["data", "prepare", str(src), str(src / "train" / "x")]) == 2
    capsys.readouterr()
    (tmp_path / "afile").write_text("x")
    for dst in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert main(["data", "prepare", str(src), str(dst), "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert "is a file, not a folder" in err and len(err.strip().splitlines()) == 1, err


def test_cli_index_summarises(tmp_path, capsys):
    src = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    assert main(["data", "index", str(src)]) == 0
    out = capsys.readouterr().out
    assert "train: 4 images" in out and "val: 2 images" in out and os.fspath(src) in out


def test_cli_index_reads_the_working_directory_as_it_reads_its_absolute_path(tmp_path, capsys, monkeypatch):
    src = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    monkeypatch.chdir(src)
    for here in (".", "./"):
        assert main(["data", "index", here]) == 0
        out = capsys.readouterr().out
        assert "train: 4 images" in out and "val: 2 images" in out, out
    assert main(["data", "index", ""]) == 2  # never read as "here"
    assert "argument PATH: an empty value" in capsys.readouterr().err


def test_copies_that_name_a_file_are_refused_not_ignored(tmp_path, monkeypatch):
    from speedrun.errors import SpeedrunError

    src = make_tree(tmp_path / "d", classes=2, train_per_class=1, val_per_class=1)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SpeedrunError, match=r"^--copies .*afile is a file, not the folder of resized copies$"):
        ImageFolderSource(src, workers=0, copies_dir=str(tmp_path / "afile"))
    monkeypatch.setenv("SPEEDRUN_COPIES", str(tmp_path / "afile"))
    with pytest.raises(SpeedrunError, match=r"^SPEEDRUN_COPIES .*afile is a file"):
        ImageFolderSource(src, workers=0)


@pytest.mark.slow
def test_workers_die_with_a_killed_prepare_and_a_rerun_finishes_cleanly(tmp_path):
    # kill -9 of the main process (what the OOM killer does) must not leave workers writing.
    src = make_tree(tmp_path / "d", classes=2, train_per_class=150, val_per_class=5, sizes=[(640, 480)])
    dst = tmp_path / "sz"
    main_proc = subprocess.Popen(["python", "-m", "speedrun", "data", "prepare", str(src), str(dst), "--sizes", "64",
                                  "--workers", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = lambda: len(list((dst / "64").rglob("*.JPEG"))) if (dst / "64").exists() else 0  # noqa: E731
    wait_for(lambda: done() >= 10 or main_proc.poll() is not None, 120, "the first outputs")
    assert main_proc.poll() is None, "prepare finished before it could be killed; make the tree larger"
    workers = children(main_proc.pid)
    assert workers
    main_proc.kill()
    main_proc.wait()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in workers), 30,
             "the workers to die with their parent")
    written = done()
    assert prepare(src, dst, [64], workers=1, progress=False).resized == 310 - written
    assert len(list((dst / "64").rglob("*.JPEG"))) == 310 and not list(dst.glob(".partial-*"))


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_cli_refuses_workers_and_sizes_out_of_bounds(tmp_path, capsys):
    src = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    for argv, expected in (
        (["prepare", str(src), str(tmp_path / "sz"), "--workers", "0"],
         "argument --workers: 0 is not a whole number in 1..256"),
        (["prepare", str(src), str(tmp_path / "sz"), "--workers", "-1"], "argument --workers: -1 is not"),
        (["prepare", str(src), str(tmp_path / "sz"), "--sizes", "1000000"],
         "argument --sizes: 1000000 is not a whole number in 1..4096"),
        (["index", str(src), "--workers", "-1"], "argument --workers: -1 is not"),
        (["index", str(src), "--workers", "0"], "argument --workers: 0 is not a whole number in 1..256"),
    ):
        assert main(["data", *argv]) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "sz").exists()


@pytest.mark.slow  # the read-only file system is a tmpfs mount (a process)
def test_cli_refuses_a_read_only_destination(tmp_path, read_only_dir, capsys):
    src = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    assert main(["data", "prepare", str(src), str(read_only_dir / "sz"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "is on a read-only file system" in err and len(err.strip().splitlines()) == 1, err
