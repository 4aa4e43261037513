"""When a scheduler steps: every update (the default), or once an epoch as
Lightning's default interval is, with Lightning's frequency."""

import pytest
import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from hookloop import Loop, Network, hookimpl
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate, tiny_loop


class Rates:
    """The learning rate each update used."""

    def __init__(self):
        self.used = []

    @hookimpl
    def before_optimizer_step(self, network):
        self.used.append(network.optimizer.param_groups[0]["lr"])


def stepped_loop(plugins=(), **schedule):
    torch.manual_seed(0)
    reference = tiny_loop(scheduler=False)
    model, optimizer = reference.networks["model"].unwrapped, torch.optim.SGD(
        reference.networks["model"].unwrapped.parameters(), lr=0.1)
    reset_accelerate()
    return Loop(model=model, optimizer=optimizer, scheduler=StepLR(optimizer, step_size=1, gamma=0.5),
                train_data=reference.train_data.base_dataloader, plugins=list(plugins), block=["progress"],
                **schedule)


def test_an_epoch_scheduler_steps_once_an_epoch_not_every_update():
    rates = Rates()
    stepped_loop([rates], scheduler_interval="epoch").fit(epochs=3)  # 8 updates an epoch
    assert rates.used == [0.1] * 8 + [0.05] * 8 + [0.025] * 8
    per_update = Rates()
    stepped_loop([per_update]).fit(epochs=1)  # the default: every update (0.01 -> 7.8e-5 in 0.2's port)
    assert per_update.used[:3] == [0.1, 0.05, 0.025]


def test_the_frequency_counts_epochs_or_updates():
    every_two_epochs = Rates()
    stepped_loop([every_two_epochs], scheduler_interval="epoch", scheduler_frequency=2).fit(epochs=3)
    assert every_two_epochs.used == [0.1] * 16 + [0.05] * 8
    every_four_updates = Rates()
    stepped_loop([every_four_updates], scheduler_frequency=4).fit(max_steps=9)
    assert every_four_updates.used == [0.1] * 4 + [0.05] * 4 + [0.025]


def test_an_epoch_ended_early_does_not_step_it_and_a_resume_continues_the_schedule(tmp_path):
    whole = Rates()
    stepped_loop([whole], scheduler_interval="epoch").fit(epochs=3)
    reset_accelerate()
    stepped_loop([Checkpoint(dir=tmp_path, signals=None)], scheduler_interval="epoch").fit(max_steps=12)
    reset_accelerate()
    resumed = Rates()
    stepped_loop([resumed, Checkpoint(dir=tmp_path, signals=None)], scheduler_interval="epoch",
                 resume_from="latest").fit(epochs=3)
    assert resumed.used == whole.used[12:]  # mid-epoch 1: the rest of it at 0.05, then 0.025


def test_a_plateau_scheduler_steps_on_the_epoch_s_metric():
    torch.manual_seed(0)
    loop = tiny_loop(scheduler=False, eval_data=True)
    network = loop.networks["model"]
    optimizer = torch.optim.SGD(network.unwrapped.parameters(), lr=0.1)
    plateau = ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
    reset_accelerate()
    rates = Rates()
    fitted = Loop(networks={"model": Network(network.unwrapped, optimizer, plateau, scheduler_interval="epoch",
                                             scheduler_monitor="train_flag")},
                  train_data=loop.train_data.base_dataloader, block=["progress"], plugins=[rates, Flat()])
    fitted.fit(epochs=3)  # train_flag never improves: the rate halves after every epoch but the first
    assert rates.used[::8] == [0.1, 0.1, 0.05]


class Flat:
    @hookimpl
    def after_step(self, loop):
        loop.log({"train_flag": 1.0}, on_step=False, on_epoch=True)


def test_bad_schedules_are_refused_naming_the_setting():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler_interval must be 'step' or 'epoch', got 'month'"):
        Network(model, optimizer, scheduler_interval="month")
    with pytest.raises(ValueError, match="scheduler_frequency must be a positive int, got 0"):
        Network(model, optimizer, scheduler_frequency=0)
    with pytest.raises(ValueError, match="scheduler_monitor .* needs scheduler_interval='epoch'"):
        Network(model, optimizer, scheduler_monitor="eval_loss")
