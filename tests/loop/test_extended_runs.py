"""Extending a finished run past the end of its learning-rate schedule: a new
process resumes a ``fit(epochs=3)`` of 24 updates with ``fit(epochs=5)``. A
linear decay built for 24 updates trains the 16 more at a learning rate of 0;
a ``OneCycleLR`` gets its ``total_steps`` of 24 back from the checkpoint and
stops stepping. The fit that extends it warns, once, before its first update,
naming the network, the scheduler and both lengths; never within the plan,
nor on a plain resume of an unfinished run. Each process is a new ``Loop``
resuming from the first one's checkpoint folder."""

import json
import warnings

import pytest
import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import get_linear_schedule_with_warmup

from hookloop import Loop, hookimpl
from hookloop.checkpointing import read_manifest
from hookloop.checkpointing.manifest import manifest_crc
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate

PER_EPOCH = 8  # updates an epoch


class Rates:
    """The learning rate each update used, and how many of the extension
    warnings had been given by the first update."""

    def __init__(self, caught):
        self.used, self.caught, self.warned_before_first_update = [], caught, None

    @hookimpl
    def before_optimizer_step(self, network):
        if self.warned_before_first_update is None:
            self.warned_before_first_update = len(past_plan(self.caught))
        self.used.append(network.optimizer.param_groups[0]["lr"])


class LinearDecay(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler class of the user's, whose length hookloop cannot read: a
    linear decay to 0 over ``total`` steps."""

    def __init__(self, optimizer, total):
        self.total = total
        super().__init__(optimizer)

    def get_lr(self):
        return [base * max(0.0, 1 - self.last_epoch / self.total) for base in self.base_lrs]


def schedule(kind, optimizer, total):
    if kind == "linear":  # transformers' schedules are LambdaLRs over a functools.partial
        return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=total)
    if kind == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total)
    if kind == "lambda":  # a closure: its length cannot be read
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
    if kind == "custom":
        return LinearDecay(optimizer, total)
    raise ValueError(kind)


def process(root, kind, total, *plugins, resume_from=None, interval="step"):
    """One process of the run: a new Loop (its scheduler built for ``total``
    of its steps) checkpointing into ``root``."""
    reset_accelerate()
    set_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return Loop(model=model, optimizer=optimizer, scheduler=schedule(kind, optimizer, total), train_data=data,
                plugins=[Checkpoint(dir=root, signals=None, every_steps=4), *plugins], block=["progress"],
                resume_from=resume_from, scheduler_interval=interval)


def past_plan(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("hookloop: network 'model': its scheduler")]


def extend(root, kind, total, epochs, interval="step", every_warning=None):
    """A new process resuming ``root``'s latest and fitting to ``epochs``:
    the extension warnings, and the learning rates it trained at;
    ``every_warning``: a list that gets every warning's text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rates = Rates(caught)
        loop = process(root, kind, total, rates, resume_from="latest", interval=interval)
        loop.fit(epochs=epochs)
        loop.close()
    if every_warning is not None:
        every_warning.extend(str(w.message) for w in caught)
    return past_plan(caught), rates


def finished_run(root, kind, total=3 * PER_EPOCH, interval="step", epochs=3):
    loop = process(root, kind, total, interval=interval)
    loop.fit(epochs=epochs)
    loop.close()


@pytest.mark.parametrize("kind", ["linear", "onecycle"])
def test_extending_a_finished_run_past_its_schedule_warns_once_before_its_first_update(tmp_path, kind):
    finished_run(tmp_path, kind)  # 3 epochs: 24 updates
    messages, rates = extend(tmp_path, kind, 24, epochs=5)  # the same script, fit(epochs=5)
    assert len(messages) == 1 and rates.warned_before_first_update == 1
    (message,) = messages
    name = {"linear": "LambdaLR", "onecycle": "OneCycleLR"}[kind]
    assert message.startswith(f"hookloop: network 'model': its scheduler {name} was planned for 24 updates")
    assert "this fit runs to update 40 (loop.total_steps)" in message and "updates 25 to 40" in message
    assert len(rates.used) == 16 and len(set(rates.used)) == 1  # what it warns about: one rate, to the end
    if kind == "linear":
        assert rates.used[0] == 0.0
        assert "its lr_lambda's num_training_steps=24" in message
        assert "its learning rate is 0 from update 24 on" in message
        assert "Build it for 40 updates before resuming (num_training_steps=40" in message
    else:
        assert "(total_steps=24)" in message and "it stops stepping there" in message
        assert "building it for 40 updates does not change it" in message  # (restored from the checkpoint)
        assert "loop.load_checkpoint(path, weights_only=True)" in message


def test_within_the_plan_no_warning_and_past_it_a_warning(tmp_path):
    finished_run(tmp_path / "planned-40", "linear", total=40)  # planned for 5 epochs, fit 3 at a time
    assert extend(tmp_path / "planned-40", "linear", 40, epochs=5)[0] == []
    finished_run(tmp_path / "planned-24", "linear")
    every = []
    assert extend(tmp_path / "planned-24", "linear", 24, epochs=3, every_warning=every)[0] == []
    assert any("trains nothing" in m for m in every)  # already there: nothing to extend
    messages, rates = extend(tmp_path / "planned-24", "linear", 40, epochs=5)  # rebuilt for 40: its plan now
    # (the first update trains at the rate saved with the optimizer; the scheduler sets the next ones)
    assert messages == [] and all(rate > 0 for rate in rates.used[1:])
    finished_run(tmp_path / "past", "linear")
    messages, _ = extend(tmp_path / "past", "linear", 24, epochs=4)  # one epoch more than planned
    assert len(messages) == 1 and "planned for 24 updates" in messages[0] and "update 32" in messages[0]


class CrashAt:
    def __init__(self, step):
        self.step = step

    @hookimpl
    def after_step(self, loop):
        if loop.state.global_step == self.step:
            raise RuntimeError("killed")


@pytest.mark.parametrize("kind", ["linear", "onecycle", "lambda", "custom"])
def test_a_plain_resume_of_an_unfinished_run_does_not_warn(tmp_path, kind):
    loop = process(tmp_path, kind, 24, CrashAt(13))
    with pytest.raises(RuntimeError, match="killed"):
        loop.fit(epochs=3)
    loop.close()
    # the checkpoint records what its fit was asked for
    assert read_manifest(tmp_path / "step-00000012")["fit"] == {"epochs": 3, "max_steps": None, "total_steps": 24}
    messages, rates = extend(tmp_path, kind, 24, epochs=3)
    assert messages == [] and len(rates.used) == 12


def _without_fit_record(checkpoint):
    """The manifest as hookloop 0.3 and 0.4.0.dev0 wrote it: no ``fit``."""
    doc = json.loads((checkpoint / "hookloop.json").read_text())
    del doc["fit"]
    doc["manifest_crc32"] = manifest_crc(doc)
    (checkpoint / "hookloop.json").write_text(json.dumps(doc))


def test_a_lambda_of_the_users_is_asked_for_the_rate_at_the_fits_end(tmp_path):
    finished_run(tmp_path / "a", "lambda")  # a closure over 24: its length cannot be read
    messages, rates = extend(tmp_path / "a", "lambda", 24, epochs=5)
    assert set(rates.used) == {0.0}
    assert messages == ["hookloop: network 'model': its scheduler LambdaLR sets a learning rate of 0 for update "
                        "40, the last of this fit (loop.total_steps), and the fit that saved the checkpoint ran to "
                        "update 24: its schedule ends before this fit does (hookloop cannot read the length its "
                        "lr_lambda was built for). Build it for 40 updates before resuming (a LambdaLR keeps the "
                        "lr_lambda it is built with, not the checkpoint's), or start a new run from the weights "
                        "with a scheduler built for the new length (loop.load_checkpoint(path, "
                        "weights_only=True)); or fit no further than update 24"]
    # built for 40: no end before this fit's
    finished_run(tmp_path / "b", "lambda")
    assert extend(tmp_path / "b", "lambda", 40, epochs=5)[0] == []
    # a checkpoint of hookloop 0.3/0.4.0.dev0 (no record of its fit): the lambda still tells
    finished_run(tmp_path / "c", "lambda")
    _without_fit_record(tmp_path / "c" / "step-00000024-epoch-end")
    messages, _ = extend(tmp_path / "c", "lambda", 24, epochs=5)
    assert len(messages) == 1 and "sets a learning rate of 0 for update 40" in messages[0]


def test_a_schedule_whose_length_cannot_be_read_is_taken_as_long_as_the_fit_that_saved_it(tmp_path):
    finished_run(tmp_path / "a", "custom")
    messages, rates = extend(tmp_path / "a", "custom", 24, epochs=5)
    assert set(rates.used) == {0.0}
    assert len(messages) == 1
    assert messages[0].startswith("hookloop: network 'model': its scheduler LinearDecay has a schedule whose "
                                  "length hookloop cannot read, and the fit that saved the checkpoint ran to "
                                  "update 24; this fit runs to update 40 (loop.total_steps). If the schedule was "
                                  "built for 24 updates, updates 25 to 40 run past its end")
    # a checkpoint of hookloop 0.3/0.4.0.dev0 does not say: it loads, and nothing is guessed
    finished_run(tmp_path / "b", "custom")
    _without_fit_record(tmp_path / "b" / "step-00000024-epoch-end")
    messages, rates = extend(tmp_path / "b", "custom", 24, epochs=5)
    assert messages == [] and len(rates.used) == 16


def test_an_epoch_scheduler_counts_epochs(tmp_path):
    finished_run(tmp_path, "linear", total=3, interval="epoch")  # num_training_steps=3 epochs
    messages, rates = extend(tmp_path, "linear", 3, epochs=5, interval="epoch")
    assert len(messages) == 1
    assert "was planned for 3 epochs (its lr_lambda's num_training_steps=3), and this fit runs to epoch 5" \
        in messages[0]
    assert "epochs 4 to 5" in messages[0] and set(rates.used) == {0.0}
