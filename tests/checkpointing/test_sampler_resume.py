"""Samplers of the user's own resume bit for bit after kill -9: one with a
numpy Generator of its own, one with a ``torch.Generator`` under another
name than ``generator``, one with torchdata's ``Stateful`` protocol; each
through a plain DataLoader and through Accelerate's
``use_stateful_dataloader=True``. Killed mid-epoch (after update 13, the
checkpoint at 12, in the second epoch, whose order depends on the state the
first epoch left) and at an epoch boundary (after update 18, the checkpoint
at 16, the second epoch's end), each run ends with the parameters of the
uninterrupted run. A sampler whose state hookloop cannot see is named in a
warning at the first checkpoint.
"""

import json
import warnings

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Sampler, TensorDataset

import runner
from hookloop import Loop
from hookloop.plugins import Checkpoint

ARGS = ("--strategy", "supervised", "--accum", "1", "--epochs", "3", "--every-steps", "4")


def shape(sampler, stateful_loader):
    return (*ARGS, "--sampler", sampler, *(["--stateful-loader"] if stateful_loader else []))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs' final parameters, by sampler (the loader does
    not change the order)."""
    out = {}
    for sampler in ("numpy", "named", "stateful"):
        out[sampler] = runner.Run(tmp_path_factory.mktemp(f"reference-{sampler}"), *shape(sampler, False)).finish()
    return out


def latest(out):
    return (out / "checkpoints" / "latest").read_text().strip()


@pytest.mark.parametrize("stateful_loader", [False, True], ids=["DataLoader", "use_stateful_dataloader"])
@pytest.mark.parametrize("sampler", ["numpy", "named", "stateful"])
def test_a_sampler_with_a_state_of_its_own_resumes_bit_for_bit_after_kill_9(tmp_path, reference, sampler,
                                                                           stateful_loader):
    args = shape(sampler, stateful_loader)
    for pause, expected in (("step:13", "step-00000012"), ("step:18", "step-00000016-epoch-end")):
        run = runner.Run(tmp_path, *args, "--pause", pause, name=pause.replace(":", "-"))
        run.wait_paused()
        run.kill()
        assert latest(tmp_path) == expected
    final = runner.Run(tmp_path, *args, name="final").finish()
    assert json.loads((tmp_path / "run.json").read_text())["started_at"] == 16
    assert runner.same(final, reference[sampler]) == []
    assert "will not resume exactly" not in (tmp_path / "final.log").read_text()


# -- what hookloop cannot see: named at the first checkpoint ----------------------------------


class HiddenState(Sampler):
    """Its generator inside a list: nothing hookloop restores."""

    def __init__(self, n):
        self.n, self.box = n, [np.random.default_rng(0)]

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.box[0].permutation(self.n).tolist())


class Counted(HiddenState):
    """A torch.Generator hookloop restores, and a pass counter it does not."""

    def __init__(self, n):
        self.n, self.g, self.passes = n, torch.Generator().manual_seed(0), 0

    def __iter__(self):
        self.passes += 1
        return iter(torch.randperm(self.n + 0 * self.passes, generator=self.g).roll(self.passes).tolist())


class GlobalRandom(HiddenState):
    """Draws from the global torch random state, which hookloop restores."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


class Sorted(GlobalRandom):
    """No randomness at all."""

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


def first_save_warnings(tmp_path, sampler):
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    model = torch.nn.Linear(4, 2)
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=DataLoader(TensorDataset(x, y), batch_size=8, sampler=sampler),
                plugins=[Checkpoint(dir=tmp_path / "ck", every_steps=2)],
                accelerator=Accelerator(cpu=True), block=["progress"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loop.fit(epochs=2)
    return [str(w.message) for w in seen if "will not resume exactly" in str(w.message)]


@pytest.mark.parametrize("sampler", [HiddenState, Counted], ids=["generator inside a list", "a pass counter"])
def test_a_sampler_whose_state_hookloop_cannot_restore_is_named_once_at_the_first_checkpoint(tmp_path, sampler):
    messages = first_save_warnings(tmp_path, sampler(32))
    assert len(messages) == 1, messages  # at the first of 8 saves only
    assert f"sampler {sampler.__qualname__} (sampler)" in messages[0]
    assert "keeps state hookloop does not see" in messages[0]


@pytest.mark.parametrize("sampler", [GlobalRandom, Sorted, NamedOnly := None], ids=["global", "sorted", "named"])
def test_samplers_hookloop_restores_get_no_warning(tmp_path, sampler):
    if sampler is None:
        from resumable import NamedGeneratorSampler as sampler
    assert first_save_warnings(tmp_path, sampler(32)) == []


@pytest.mark.parametrize("data", ["stateful", "map"], ids=["stream, StatefulDataLoader", "map, stateful loader"])
def test_a_stateful_loader_killed_after_an_epoch_end_checkpoint_resumes_bit_for_bit(tmp_path_factory, data):
    # the checkpoint at update 8 is the first epoch's end: the loader's saved state is of a
    # finished iterator; the second epoch must draw what the uninterrupted run draws
    args = ("--accum", "1", "--epochs", "2", "--every-steps", "4", "--data", data,
            *(["--stateful-loader"] if data == "map" else []))
    reference = runner.Run(tmp_path_factory.mktemp("reference"), *args).finish()
    out = tmp_path_factory.mktemp("killed")
    run = runner.Run(out, *args, "--pause", "step:10", name="killed")
    run.wait_paused()
    run.kill()
    assert latest(out) == "step-00000008-epoch-end"
    final = runner.Run(out, *args, name="final").finish()
    assert json.loads((out / "run.json").read_text())["started_at"] == 8
    assert runner.same(final, reference) == []
