"""Continuing a hand-written Accelerate script's run: a folder of a plain
``accelerator.save_state`` given to ``Loop(resume_from=...)`` /
``loop.load_checkpoint`` continues as the script itself continues it
(``load_state``, then ``skip_first_batches`` mid-epoch or the next epoch),
bit for bit."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.checkpointing import CheckpointError, read_latest, read_manifest
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate

EPOCHS = 2
BATCHES = 8  # per epoch: 64 examples, batches of 8


def build(hidden=16, n=64):
    """The script's objects, seeded: an MLP with dropout, Adam, a warm-up
    schedule, shuffled data (so the random states decide what is trained)."""
    set_seed(0)
    x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(hidden, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    return model, optimizer, scheduler, data


def outcome(model, optimizer, scheduler):
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(), "lr": scheduler.get_last_lr()}


def script(root, *, accum=1, save=(), resume=None, config=None, n=64):
    """The hand-written loop, as Accelerate's ``checkpointing.py`` and the
    ``run_*_no_trainer.py`` scripts write it: ``save_state`` into
    ``step_<updates>`` and ``epoch_<e>``; continued from ``resume`` by
    ``load_state``, the position from its name, ``skip_first_batches``."""
    reset_accelerate()
    acc = Accelerator(gradient_accumulation_steps=accum, project_config=config)
    model, optimizer, scheduler, data = build(n=n)
    model, optimizer, data, scheduler = acc.prepare(model, optimizer, data, scheduler)
    start = skip = done = 0
    if resume is not None:
        acc.load_state(str(resume))
        kind, n = resume.name.split("_")
        if kind == "epoch":
            start = int(n) + 1
            done = start * len(data) // accum
        else:
            done = int(n)
            start, skip = divmod(done * accum, len(data))
    for epoch in range(start, EPOCHS):
        model.train()
        active = acc.skip_first_batches(data, skip) if epoch == start and skip else data
        for inputs, targets in active:
            with acc.accumulate(model):
                acc.backward(F.cross_entropy(model(inputs), targets))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if acc.sync_gradients:
                done += 1
                if f"step_{done}" in save:
                    acc.save_state(str(root / f"step_{done}"))
        if f"epoch_{epoch}" in save:
            acc.save_state(None if config else str(root / f"epoch_{epoch}"))
    return outcome(acc.unwrap_model(model), optimizer, scheduler)


def continued(resume_from=None, *, accum=1, plugins=(), load=None, hidden=16, n=64):
    """hookloop on the script's objects, from the script's folder."""
    reset_accelerate()
    model, optimizer, scheduler, data = build(hidden, n)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                accelerator=Accelerator(gradient_accumulation_steps=accum), plugins=list(plugins),
                block=["progress"], resume_from=resume_from)
    if load is not None:
        load(loop)
    return loop


def assert_same(loop, expected):
    net = loop.networks["model"]
    got = outcome(net.unwrapped, net.optimizer, net.scheduler)
    differing = [k for k in expected["params"] if not torch.equal(expected["params"][k], got["params"][k])]
    assert not differing, differing
    saved, now = expected["optimizer"], got["optimizer"]
    assert saved["param_groups"] == now["param_groups"]
    for key, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, now["state"][key][name]), (key, name)
    assert got["lr"] == expected["lr"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One script run saving mid-epoch (after 5 updates) and at epoch 0's end."""
    root = tmp_path_factory.mktemp("script")
    script(root, save=("step_5", "epoch_0"))
    return root


@pytest.mark.parametrize("name, position", [("step_5", (0, 5, 5)), ("epoch_0", (1, 0, BATCHES))])
def test_a_loop_continues_a_save_state_folder_as_the_script_does(saved, tmp_path, name, position):
    expected = script(saved, resume=saved / name)  # the script itself, continued
    checkpoint = Checkpoint(dir=tmp_path / "hookloop", every_steps=4, signals=None)
    loop = continued(saved / name, plugins=[checkpoint])
    state = loop.state
    assert (state.epoch, state.step_in_epoch, state.global_step) == position
    assert loop.resumed_from == saved / name
    loop.fit(epochs=EPOCHS)
    assert_same(loop, expected)
    # its later checkpoints are hookloop's, of a run of its own
    latest = tmp_path / "hookloop" / read_latest(tmp_path / "hookloop")
    assert read_manifest(latest)["run_id"] == state.run.id


def test_step_names_count_updates_under_gradient_accumulation(tmp_path):
    script(tmp_path, accum=2, save=("step_3",))  # 3 updates of 2 batches
    expected = script(tmp_path, accum=2, resume=tmp_path / "step_3")
    loop = continued(tmp_path / "step_3", accum=2)
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (0, 6, 3)
    loop.fit(epochs=EPOCHS)
    assert_same(loop, expected)


def test_step_names_count_updates_also_when_an_epoch_ends_in_a_partial_group(tmp_path):
    # 7 batches, groups of 2: 4 updates per epoch (the last of one batch), so
    # step_5 is epoch 1 after 2 batches, where n * k // batches would say 3
    script(tmp_path, accum=2, save=("step_5",), n=56)
    with pytest.warns(RuntimeWarning, match=r"epoch 1 after 2 batches .* epoch 1 after 3\)"):
        loop = continued(tmp_path / "step_5", accum=2, n=56)
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (1, 2, 5)
    assert loop.state.micro_step == 9


def test_a_folder_named_otherwise_needs_the_position_named(saved, tmp_path):
    shutil.copytree(saved / "step_5", tmp_path / "my_run")
    with pytest.raises(CheckpointError, match=r"position='step_<updates>'") as info:
        continued(tmp_path / "my_run")
    assert "my_run" in str(info.value) and "accelerator.save_state" in str(info.value)

    expected = script(saved, resume=saved / "step_5")
    for position in ("step_5", {"epoch": 0, "step_in_epoch": 5}):
        loop = continued(load=lambda loop: loop.load_checkpoint(tmp_path / "my_run", position=position))
        loop.fit(epochs=EPOCHS)
        assert_same(loop, expected)
    with pytest.raises(CheckpointError, match=r"position=\{'epoch': 0\} has no 'step_in_epoch'"):
        continued(load=lambda loop: loop.load_checkpoint(tmp_path / "my_run", position={"epoch": 0}))


def test_accelerates_automatic_naming_takes_the_newest_folder(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    script(tmp_path, save=("epoch_0",), config=config)
    folder = tmp_path / "checkpoints" / "checkpoint_10"
    (tmp_path / "checkpoints" / "checkpoint_0").rename(folder)
    shutil.copytree(folder, tmp_path / "epoch_0")  # for the script, which reads its name
    older = tmp_path / "checkpoints" / "checkpoint_9"  # older by number, not by letters
    shutil.copytree(folder, older)
    (older / "model.safetensors").write_bytes(b"damaged")
    expected = script(tmp_path, resume=tmp_path / "epoch_0")
    with pytest.raises(CheckpointError, match="checkpoint_10.*position="):
        continued(tmp_path / "checkpoints")
    loop = continued(load=lambda loop: loop.load_checkpoint(tmp_path, position="epoch_0"))
    assert loop.resumed_from == folder
    loop.fit(epochs=EPOCHS)
    assert_same(loop, expected)


def test_a_folder_of_another_model_shape_is_refused_naming_the_tensor(saved):
    loop = continued(hidden=32)
    before = {k: v.clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"tensor '0\.bias' has shape \[16\] in the "
                                              r"checkpoint but \[32\] in this model"):
        loop.load_checkpoint(saved / "step_5")
    after = loop.networks["model"].unwrapped.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert loop.state.global_step == 0 and loop.resumed_from is None
