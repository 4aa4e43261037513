"""A checkpoint folder must be one folder for every process: a save whose
ranks wrote into different folders, or a resume that some ranks cannot see,
fails on every rank with one CheckpointError naming the rank, never a
checkpoint without a rank's files, never a hang, never some ranks starting
from scratch while the others resume."""

import json
import os
from pathlib import Path

import launching
import pytest

from hookloop import checkpointing
from hookloop.checkpointing import CheckpointError, read_latest
from hookloop.plugins import Checkpoint
from hookloop.testing import tiny_loop

SHARED = "A checkpoint folder must be visible to every process: a shared file system"


def results(out: Path, phase: str) -> list[dict]:
    return [json.loads((out / f"{phase}-{r}.json").read_text()) for r in (0, 1)]


def test_a_save_whose_rank_files_did_not_land_publishes_nothing(tmp_path, monkeypatch):
    loop = tiny_loop([Checkpoint(dir=tmp_path, every_steps=None, every_epoch=True, keep_last=None)])
    loop.fit(epochs=1)
    before = read_latest(tmp_path)
    try:
        from hookloop.checkpointing import codec as module
        attribute = "write_rank_file"
    except ImportError:  # hookloop 0.2: one module
        module, attribute = checkpointing, "_write_rank_file"
    written = getattr(module, attribute)

    def elsewhere(path, loop):  # as if this rank's root were another machine's disk
        return written(tmp_path.parent / f"elsewhere-{Path(path).name}", loop)

    monkeypatch.setattr(module, attribute, elsewhere)
    with pytest.raises(CheckpointError) as caught:
        loop.fit(epochs=2)
    message = str(caught.value)
    assert "rank 0 wrote its files, but they are not in" in message
    assert "hookloop-rank0.safetensors" in message and ".tmp-step-" in message
    assert SHARED in message
    assert read_latest(tmp_path) == before  # nothing published
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == []


@pytest.mark.slow
def test_a_save_into_a_root_that_rank_1_does_not_share_fails_on_both_ranks(tmp_path):
    code, output = launching.two_ranks("unshared_folders.py", tmp_path, "save", timeout=60)
    assert code is not None, "the run hung:\n" + output[-3000:]
    saves = results(tmp_path, "save")
    for rank, save in enumerate(saves):
        assert "error" in save, f"rank {rank} saved: {save}\n{output[-3000:]}"
        assert "rank 1 wrote its files, but they are not in" in save["message"]
        assert str(tmp_path / "disk0" / "checkpoints" / ".tmp-step-00000002") in save["message"]
        assert "random_states_1.pkl" in save["message"] and SHARED in save["message"]
    assert saves[0]["message"] == saves[1]["message"]
    for disk in ("disk0", "disk1"):  # nothing published, no temporary folder left behind
        assert os.listdir(tmp_path / disk / "checkpoints") == []


@pytest.mark.slow
def test_a_resume_that_one_rank_cannot_see_fails_on_both_ranks(tmp_path):
    code, output = launching.two_ranks("unshared_folders.py", tmp_path, "resume", timeout=60)
    assert code is not None, "the run hung:\n" + output[-3000:]
    assert [r.get("ok") for r in results(tmp_path, "train")] == [4, 4], output[-3000:]
    latest = tmp_path / "shared" / "checkpoints" / "step-00000004-epoch-end"

    # rank 1's root is its own empty disk: both fail, naming rank 1 and the checkpoint
    blind = results(tmp_path, "rank1-blind")
    for rank, result in enumerate(blind):
        assert result.get("error") == "CheckpointError", f"rank {rank}: {result}"
        message = result["message"]
        assert f"rank 1 cannot see checkpoint '{latest}'" in message
        assert str(tmp_path / "disk1" / "checkpoints") in message
        assert SHARED + ", or copy it to each machine" in message
    assert blind[0]["message"] == blind[1]["message"]

    # rank 0 sees nothing, rank 1 sees checkpoints: not a fresh start on rank 0 only
    blind = results(tmp_path, "rank0-blind")
    for rank, result in enumerate(blind):
        assert result.get("error") == "CheckpointError", f"rank {rank}: {result}"
        assert "rank 0 sees no checkpoint in" in result["message"]
        assert "rank 1 sees step-00000002, step-00000004-epoch-end" in result["message"]
        assert SHARED in result["message"]

    # copied to rank 1's disk: both resume from the same checkpoint
    copied = results(tmp_path, "copied")
    assert copied[0] == {"ok": str(latest)}
    assert copied[1] == {"ok": str(tmp_path / "copy" / "checkpoints" / latest.name)}
