"""Every hook in hookspecs.py is called by the loop, with exactly its
documented arguments: a new hook without a caller fails here."""

import inspect

import pytest

from hookloop import Loop, hookspecs
from hookloop.manager import hook_names
from hookloop.testing import HookRecorder, tiny_loop


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    import torch

    from hookloop import checkpointing
    from hookloop.plugins import Checkpoint, GradClip
    from hookloop.testing import reset_accelerate

    reset_accelerate()
    recorder = HookRecorder()
    root = tmp_path_factory.mktemp("checkpoints")
    loop = tiny_loop([recorder, Checkpoint(dir=root, signals=None), GradClip(max_norm=1.0)], n=16,
                     eval_data=True)
    loop.fit(epochs=1)
    reset_accelerate()
    resumed = tiny_loop([recorder, Checkpoint(dir=root, signals=None)], n=16, resume_from="latest")
    with torch.no_grad():
        next(resumed.networks["model"].model.parameters()).fill_(float("nan"))
    with pytest.raises(checkpointing.NonFiniteCheckpoint):  # asks when it went bad
        checkpointing.save(resumed, root, reason="test")

    class Boom:
        from hookloop import hookimpl

        @hookimpl
        def on_epoch_start(self):
            raise RuntimeError("boom")

    reset_accelerate()
    failing = tiny_loop([recorder, Boom()], n=8)
    with pytest.raises(Exception):
        failing.fit(epochs=1)
    return recorder, loop


@pytest.mark.parametrize("hook", hook_names())
def test_hook_is_called_with_its_arguments(hook, recorded):
    recorder, loop = recorded
    calls = recorder.calls_of(hook)
    assert calls, f"the loop never calls {hook}"
    spec_args = list(inspect.signature(getattr(hookspecs, hook)).parameters)
    for kwargs in calls:
        assert list(kwargs) == spec_args
        assert isinstance(kwargs["loop"], Loop)
