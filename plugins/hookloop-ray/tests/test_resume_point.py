"""Which checkpoint ``resume_from=hookloop_ray.resume_point()`` resumes, in
this process, with ``ray.train`` replaced by one whose ``get_checkpoint()``
gives back a copy of a checkpoint (as Ray's storage holds one) or None: the
newest that exists, Ray's or the ``Checkpoint`` folder's (Ray's on a tie),
and the run then ends bit for bit where an uninterrupted one ends. Ray
registers a reported checkpoint only when its controller next polls the
workers: a worker that dies right after a report leaves Ray with an older
checkpoint than the folder, or none."""

import shutil
import types

import pyarrow.fs
import pytest
import torch

import hookloop_ray
from hookloop import hookimpl
from hookloop.plugins import Checkpoint
from hookloop.testing import parameters

EPOCHS = 2  # 8 updates an epoch: saves at 3, 6, 8 (epoch end), ..., 16 (epoch end)


def fake_ray(monkeypatch, given=None):
    """``ray.train`` as a worker sees it: reports go nowhere, ``get_checkpoint()`` gives ``given``."""
    monkeypatch.setattr(hookloop_ray, "_train", lambda: types.SimpleNamespace(
        get_checkpoint=lambda: given, report=lambda metrics, checkpoint=None: None,
        Checkpoint=types.SimpleNamespace(from_directory=lambda path: path)))


def saving(folder):
    return Checkpoint(dir=folder, every_steps=3, keep_last=None)


def ray_copy(checkpoint, storage):
    """What ``ray.train.report(..., checkpoint=Checkpoint.from_directory(checkpoint))``
    leaves in Ray's storage, as ``ray.train.get_checkpoint()`` gives it back."""
    copy = storage / "checkpoint_000000"
    shutil.copytree(checkpoint, copy)
    return types.SimpleNamespace(path=str(copy), filesystem=pyarrow.fs.LocalFileSystem())


class DiesIn:
    """The worker dies in update ``step`` (before its safe point: nothing saved there)."""

    def __init__(self, step):
        self.step = step

    @hookimpl
    def after_step(self, loop):
        if loop.state.global_step == self.step:
            raise RuntimeError(f"the worker died in update {self.step}")


def keep_until(folder, name):
    """The folder as a run killed right after saving ``name`` left it."""
    for later in sorted(p for p in folder.iterdir() if p.name.startswith("step-") and p.name > name):
        shutil.rmtree(later)
    (folder / "latest").write_text(name + "\n")


# (the folder as the failure left it, Ray's copy of which checkpoint, what the restart resumes);
# Ray newer: a folder that lost its newest (a node's own disk, a rollback); none from Ray with
# checkpoints in the folder: a worker died before Ray's controller registered any report
CASES = {
    "ray-newer": ("step-00000003", "step-00000006", "ray"),
    "folder-newer": ("step-00000008-epoch-end", "step-00000003", "step-00000008-epoch-end"),
    "tie": ("step-00000006", "step-00000006", "ray"),
    "ray-none": ("step-00000006", None, "step-00000006"),
    "both-none": (None, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_restart_resumes_the_newest_checkpoint_ray_s_or_the_folder_s(case, tiny_loop, tmp_path,
                                                                           monkeypatch):
    folder_until, ray_has, expected = CASES[case]
    reference = tiny_loop([saving(tmp_path / "reference")])
    reference.fit(epochs=EPOCHS)
    want = parameters(reference)
    reference.close()

    folder, storage = tmp_path / "shared", tmp_path / "ray"
    storage.mkdir()
    if folder_until is not None:  # the attempt that died in update 9, then the folder as the failure left it
        fake_ray(monkeypatch)
        first = tiny_loop([saving(folder), hookloop_ray.RayReport(), DiesIn(9)])
        with pytest.raises(RuntimeError, match="died"):
            first.fit(epochs=EPOCHS)
        first.close()
        given = ray_copy(folder / ray_has, storage) if ray_has else None
        keep_until(folder, folder_until)
    else:
        given = None
    fake_ray(monkeypatch, given)

    restarted = tiny_loop([saving(folder), hookloop_ray.RayReport()], resume_from=hookloop_ray.resume_point())
    if expected is None:
        assert restarted.resumed_from is None and restarted.state.global_step == 0
    else:
        place = storage / "checkpoint_000000" if expected == "ray" else folder / expected
        assert restarted.resumed_from == place
        assert restarted.state.global_step == int((ray_has if expected == "ray" else expected)[5:13])
    restarted.fit(epochs=EPOCHS)  # (the folder's checkpoints are this run's: not refused)
    assert restarted.state.global_step == 16
    assert all(torch.equal(a, b) for a, b in zip(parameters(restarted), want, strict=True))
    restarted.close()
