"""Helpers for testing hookloop plugins, shipped as a pytest plugin.

``pip install hookloop`` registers this module under ``pytest11``, so every
plugin's test suite gets these fixtures without a conftest:

``hookloop_recorder``
    a fresh :class:`HookRecorder`; pass it in ``plugins=[...]``.
``tiny_loop``
    :func:`tiny_loop`, a factory for a seeded supervised loop on synthetic
    data (``tiny_loop(plugins=[...])``).
``fresh_accelerator``
    resets Accelerate's process-wide singletons before and after a test, so
    that an ``Accelerator(gradient_accumulation_steps=2)`` in one test does not
    leak into the next.

and, for direct use: :func:`registered` (a plugin for one block only).
"""

from __future__ import annotations

import contextlib
from collections import namedtuple

import pytest

from .manager import hook_names
from .markers import hookimpl
from .manager import _spec_args

Call = namedtuple("Call", "hook kwargs")


class _RecorderBase:
    name = "recorder"

    def __init__(self, hooks=None):
        #: every call seen, in order: ``Call(hook, kwargs)``
        self.calls: list[Call] = []
        self._only = set(hooks) if hooks is not None else None

    def _record(self, hook, kwargs):
        if self._only is None or hook in self._only:
            self.calls.append(Call(hook, kwargs))

    def names(self) -> list[str]:
        """The hook names called, in order."""
        return [c.hook for c in self.calls]

    def calls_of(self, hook: str) -> list[dict]:
        """The keyword arguments of every call of one hook."""
        return [c.kwargs for c in self.calls if c.hook == hook]

    def clear(self):
        self.calls.clear()


def _recording_method(hook):
    args = _spec_args(hook)
    src = (
        f"def {hook}(self, {', '.join(args)}):\n"
        f"    self._record({hook!r}, {{{', '.join(f'{a!r}: {a}' for a in args)}}})\n"
    )
    namespace: dict = {}
    exec(src, namespace)  # noqa: S102 - builds a method with the hook's exact signature
    return hookimpl(tryfirst=True)(namespace[hook])


#: A plugin that implements every hook (``tryfirst``, returning ``None``) and
#: records each call with its arguments. ``HookRecorder(hooks=[...])`` records
#: only those hooks (all are still implemented, so all are still called).
HookRecorder = type(
    "HookRecorder",
    (_RecorderBase,),
    {hook: _recording_method(hook) for hook in hook_names()},
)


@contextlib.contextmanager
def registered(loop, plugin, name=None):
    """Register ``plugin`` on ``loop`` for the ``with`` block only."""
    from .manager import plugin_name

    name = name or plugin_name(plugin)
    loop.plugins.register(plugin, name, "test")
    try:
        yield plugin
    finally:
        loop.plugins.unregister(name)


def reset_accelerate():
    """Forget Accelerate's process-wide state (a test helper, not for training)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_loop(plugins=(), *, n=64, batch_size=8, features=8, classes=3, seed=0,
              accelerator=None, scheduler=True, eval_data=False, **loop_kwargs):
    """A seeded supervised :class:`~hookloop.Loop`: a small MLP with dropout on
    ``n`` random ``(inputs, targets)`` examples, Adam, and (by default) a linear
    warm-up schedule sized for 2 epochs. The progress bar is blocked."""
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    from .loop import Loop

    set_seed(seed)
    x = torch.randn(n, features)
    y = torch.randint(0, classes, (n,))
    model = torch.nn.Sequential(
        torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(16, classes),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    sched = None
    if scheduler:
        from torch.optim.lr_scheduler import LambdaLR

        total = 2 * len(train)
        warmup = max(1, total // 10)
        sched = LambdaLR(optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / (total - warmup))))
    evald = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=batch_size) if eval_data else None
    loop_kwargs.setdefault("block", ["progress"])
    return Loop(model=model, optimizer=optimizer, scheduler=sched, train_data=train,
                eval_data=evald, plugins=list(plugins), accelerator=accelerator, **loop_kwargs)


# -- the pytest plugin ------------------------------------------------------


@pytest.fixture
def fresh_accelerator():
    reset_accelerate()
    yield
    reset_accelerate()


@pytest.fixture
def hookloop_recorder():
    return HookRecorder()


@pytest.fixture(name="tiny_loop")
def tiny_loop_fixture(fresh_accelerator):
    return tiny_loop
