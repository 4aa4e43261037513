"""No host-device synchronisation per step with the default plugins.

On a GPU every ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()`` of a device tensor waits for the device. The test runs on the CPU
with the model's outputs marked as device tensors (a tensor subclass that
stays a "device" tensor through every op and becomes a plain "host" tensor
when copied ``.to("cpu")``), and counts those calls on device tensors between
the start of ``before_step`` and the end of ``after_step``.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hookloop import hookimpl
from hookloop.plugins import FiniteCheck, GradClip, Logger

SYNCS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy"}


class DeviceTensor(torch.Tensor):
    """A tensor that lives "on the device": a copy to the CPU is a host tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.to and _to_cpu(args, kwargs) and isinstance(out, torch.Tensor):
            return out.as_subclass(torch.Tensor).clone()  # the host copy
        return out


def _to_cpu(args, kwargs):
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return str(target).startswith("cpu")


class OnDevice(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).as_subclass(DeviceTensor)


class CountSyncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.in_step = False
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.in_step and name in SYNCS and args and isinstance(args[0], DeviceTensor):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class StepWindow:
    """Opens the counting window at the very start of before_step and closes
    it at the very end of after_step."""

    def __init__(self, mode):
        self.mode = mode
        self.steps = 0

    @hookimpl(tryfirst=True)
    def before_step(self):
        self.mode.in_step = True

    @hookimpl(trylast=True)
    def after_step(self):
        self.mode.in_step = False
        self.steps += 1


def run(tiny_loop, monkeypatch, plugins=(), steps=40, progress=True, lines=False):
    # as on an accelerator: FiniteCheck keeps the losses and checks them every 100 steps
    monkeypatch.setattr(FiniteCheck, "_host_device", staticmethod(lambda loop: False))
    mode = CountSyncs()
    window = StepWindow(mode)
    block = [] if progress else ["progress"]
    loop = tiny_loop([window, *plugins], n=8 * steps, block=block)
    network = loop.networks["model"]
    network.model = OnDevice(network.model)
    if progress and lines:
        loop.plugins.get("progress").lines = True  # its plain lines (as off a terminal)
    elif progress:
        loop.plugins.get("progress").disable = False  # draw it, even off a terminal
    with mode:
        loop.fit(max_steps=steps)
    assert window.steps == steps
    return mode.calls


def test_the_default_plugins_do_not_synchronise_in_any_step(tiny_loop, monkeypatch):
    assert run(tiny_loop, monkeypatch) == []


def test_the_count_is_sharp(tiny_loop, monkeypatch):
    """A plugin that reads the loss on every step is seen."""

    class Reads:
        @hookimpl
        def after_step(self, loss):
            loss.item()

    assert run(tiny_loop, monkeypatch, [Reads()], steps=12) == ["item"] * 12


def test_the_logger_reads_exactly_what_it_documents(tiny_loop, monkeypatch):
    # every 10 updates the loss (.item()); the gradient norm GradClip measured
    # (float(), documented too) is computed from the parameters' gradients, host
    # tensors in this simulation, so it is not counted here
    calls = run(tiny_loop, monkeypatch, [GradClip(max_norm=1.0), Logger(every=10, console=False)])
    assert calls == ["item"] * 4


def test_the_progress_bar_shows_a_loss_it_copied_without_waiting(tiny_loop, monkeypatch, capsys):
    calls = run(tiny_loop, monkeypatch, steps=30)
    assert calls == []
    assert "loss=" in capsys.readouterr().err  # tqdm writes to stderr


def test_the_progress_lines_show_losses_and_logged_values_copied_without_waiting(tiny_loop, monkeypatch, capsys):
    class LogsOutputs:  # a device scalar given to loop.log, no tracker: the lines show it
        @hookimpl
        def after_step(self, loop, outputs):
            loop.log({"outputs_mean": outputs.mean()})

    calls = run(tiny_loop, monkeypatch, [LogsOutputs()], steps=30, lines=True)
    assert calls == []
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("update ")]
    assert len(lines) == 11 and all(" | loss " in line and " outputs_mean " in line for line in lines), lines
