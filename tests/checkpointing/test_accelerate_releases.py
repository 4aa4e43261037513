"""A resume is bit for bit on every Accelerate release hookloop declares
(``accelerate>=1.6``; and on 1.1 to 1.5, checked by hand), although a
resumed epoch's loader (``accelerator.skip_first_batches``) differs between
them:

- before 1.15 (Accelerate PR 4071) the loader it returns starts at epoch 0
  (``iteration``), so a sampler or a stream shuffled per epoch
  (``use_seedable_sampler=True``, a ``datasets`` stream's ``shuffle``) would
  draw epoch 0's order in the resumed epoch;
- before 1.9 a loader with no batch left (an epoch resumed after its last
  batch) yields one ``None``, then fails.

Each run here is compared with the uninterrupted run, on the installed
Accelerate and with the older releases' behaviour put in its place (CI also
runs the fast suite on the oldest declared release, where it is real).
"""

import json

import accelerate.accelerator
import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.utils import DataLoaderConfiguration, set_seed, synchronize_rng_states
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate

ROWS, BATCH = 64, 8  # 8 batches an epoch


@pytest.fixture
def before_1_15(monkeypatch):
    """``skip_first_batches`` as accelerate 1.1 to 1.14 have it: the loader it
    returns starts at ``iteration=0`` (what PR 4071 changed)."""
    original = accelerate.accelerator.skip_first_batches

    def skip_first_batches(dataloader, num_batches=0):
        skipped = original(dataloader, num_batches=num_batches)
        skipped.iteration = 0
        return skipped

    monkeypatch.setattr(accelerate.accelerator, "skip_first_batches", skip_first_batches)


@pytest.fixture
def before_1_9(monkeypatch):
    """``DataLoaderShard.__iter__`` as accelerate 1.1 to 1.8 have it for a
    loader with no batch: one ``None``, then an UnboundLocalError (their
    ``current_batch`` was never set); any other loader as installed."""
    original = DataLoaderShard.__iter__

    def iterate(self):
        if len(self.base_dataloader) != 0:
            yield from original(self)
            return
        if self.rng_types is not None:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        self.set_epoch(self.iteration)
        batches = self.base_dataloader.__iter__()
        try:
            next(batches)
        except StopIteration:
            yield
        raise UnboundLocalError("cannot access local variable 'current_batch' where it is not associated "
                                "with a value")

    monkeypatch.setattr(DataLoaderShard, "__iter__", iterate)


class RequestAt:
    """Asks the Checkpoint plugin for a save at the safe point of update
    ``step`` (the last of an epoch: saved before the epoch's end ran, as a
    preemption signal in its last batch has it saved)."""

    def __init__(self, checkpoint, step):
        self.checkpoint, self.step = checkpoint, step

    @hookimpl
    def after_step(self, loop):
        if loop.state.global_step == self.step:
            self.checkpoint.request()


def run(root, *, data, resume=None, request_at=None, **fit):
    """Train an MLP with dropout; ``data``: ``"seedable"`` (a shuffled
    map-style loader, ``use_seedable_sampler=True``) or ``"stream"`` (a
    ``datasets`` stream shuffled per epoch). Returns the parameters and the loop."""
    reset_accelerate()
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 8, generator=g), torch.randint(0, 3, (ROWS,), generator=g)
    if data == "seedable":
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    else:
        datasets = pytest.importorskip("datasets")
        path = root.parent / f"{root.name}-rows.jsonl"
        path.write_text("".join(json.dumps({"x": a.tolist(), "label": int(b)}) + "\n" for a, b in zip(x, y)))
        stream = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
        loader = DataLoader(stream.shuffle(seed=0, buffer_size=16), batch_size=BATCH, collate_fn=lambda rows: (
            torch.tensor([r["x"] for r in rows]), torch.tensor([r["label"] for r in rows])))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=data == "seedable"))
    checkpoint = Checkpoint(dir=root, every_steps=3, keep_last=None, signals=None)
    plugins = [checkpoint] + ([RequestAt(checkpoint, request_at)] if request_at else [])
    loop = Loop(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), train_data=loader,
                accelerator=accelerator, block=["progress"], resume_from=resume, plugins=plugins)
    loop.fit(**fit)
    loop.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), loop


@pytest.mark.parametrize("release", ["installed", "before 1.15"])
@pytest.mark.parametrize("data", ["seedable", "stream"])
def test_an_epoch_shuffled_per_epoch_resumed_mid_epoch_ends_bit_for_bit_equal(tmp_path, request, data, release):
    whole, _ = run(tmp_path / "whole", data=data, epochs=3)
    if release != "installed":
        request.getfixturevalue("before_1_15")
    run(tmp_path / "cut", data=data, max_steps=13)  # update 5 of epoch 1: its order is epoch 1's
    resumed, loop = run(tmp_path / "cut", data=data, resume="latest", epochs=3)
    assert loop.resumed_from.name == "step-00000013" and loop.state.global_step == 24
    assert torch.equal(resumed, whole)


def test_the_epoch_order_matters_here(tmp_path):
    """The equalities above mean something: epoch 1 resumed in epoch 0's
    order (the loader's epoch left at 0) ends elsewhere."""
    whole, _ = run(tmp_path / "whole", data="seedable", epochs=3)
    run(tmp_path / "cut", data="seedable", max_steps=13)
    original = accelerate.accelerator.skip_first_batches

    def in_epoch_0(dataloader, num_batches=0):
        dataloader.set_epoch(0)
        return original(dataloader, num_batches=num_batches)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(accelerate.accelerator, "skip_first_batches", in_epoch_0)
        resumed, _ = run(tmp_path / "cut", data="seedable", resume="latest", epochs=3)
    assert not torch.equal(resumed, whole)


@pytest.mark.parametrize("release", ["installed", "before 1.9"])
def test_an_epoch_saved_after_its_last_batch_before_its_end_resumes_bit_for_bit(tmp_path, request, release):
    """A save at the last update's safe point (a preemption signal in the
    epoch's last batch; asked for here): the resumed epoch has no batch left,
    and runs its end."""
    whole, _ = run(tmp_path / "whole", data="seedable", request_at=16, epochs=3)
    saved = tmp_path / "whole" / "step-00000016"  # update 8 of epoch 1, its end not run
    assert json.loads((saved / "hookloop.json").read_text())["loop"]["step_in_epoch"] == ROWS // BATCH
    if release != "installed":
        request.getfixturevalue("before_1_9")
    resumed, loop = run(tmp_path / "again", data="seedable", resume=saved, epochs=3)
    assert loop.resumed_from == saved and loop.state.global_step == 24
    assert torch.equal(resumed, whole)
