"""Helpers for testing hookloop plugins, shipped as a pytest plugin.

``pip install hookloop`` registers this module under ``pytest11``, so every
plugin's test suite gets these fixtures without a conftest:

``hookloop_recorder``
    a fresh :class:`HookRecorder`; pass it in ``plugins=[...]``.
``tiny_loop``
    :func:`tiny_loop`, a factory for a seeded supervised loop on synthetic
    data (``tiny_loop(plugins=[...])``).
``tiny_gan_loop``
    :func:`tiny_gan_loop`, the same for the two-network GAN strategy
    (``tiny_gan_loop(plugins=[...])``).
``fresh_accelerator``
    resets Accelerate's process-wide singletons before and after a test, so
    that an ``Accelerator(gradient_accumulation_steps=2)`` in one test does not
    leak into the next.
``isolated_plugins``
    no installed plugin autoloads during the test (plugins named in
    ``plugins=[...]`` still load): a profiler or tracker someone installed
    next to yours cannot change what your test sees. ``tiny_loop`` and
    ``tiny_gan_loop`` use it.

and, for direct use: :func:`registered` (a plugin for one block only),
:func:`parameters` (a copy of a network's parameters, to compare runs),
:func:`no_installed_plugins` (the isolation as a context manager) and the
factories themselves.
"""

from __future__ import annotations

import contextlib
import os
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from .markers import hookimpl
from .validation import _spec_args, hook_names

if TYPE_CHECKING:  # names for the annotations only
    import torch

    from .loop import Loop
    from .protocols import LoopLike

_Plugin = TypeVar("_Plugin")

Call = namedtuple("Call", "hook kwargs")


class _RecorderBase:
    name = "recorder"

    def __init__(self, hooks: Iterable[str] | None = None) -> None:
        #: every call seen, in order: ``Call(hook, kwargs)``
        self.calls: list[Call] = []
        self._only = set(hooks) if hooks is not None else None

    def _record(self, hook: str, kwargs: dict[str, Any]) -> None:
        if self._only is None or hook in self._only:
            self.calls.append(Call(hook, kwargs))

    def names(self) -> list[str]:
        """The hook names called, in order."""
        return [c.hook for c in self.calls]

    def calls_of(self, hook: str) -> list[dict[str, Any]]:
        """The keyword arguments of every call of one hook."""
        return [c.kwargs for c in self.calls if c.hook == hook]

    def count(self, hook: str) -> int:
        """How many times one hook was called."""
        return sum(1 for c in self.calls if c.hook == hook)

    def clear(self) -> None:
        self.calls.clear()


def _recording_method(hook: str) -> Callable[..., None]:
    args = _spec_args(hook)
    src = (
        f"def {hook}(self, {', '.join(args)}):\n"
        f"    self._record({hook!r}, {{{', '.join(f'{a!r}: {a}' for a in args)}}})\n"
    )
    namespace: dict[str, Any] = {}
    exec(src, namespace)  # noqa: S102 - builds a method with the hook's exact signature
    method: Callable[..., None] = namespace[hook]
    return hookimpl(tryfirst=True)(method)


#: A plugin that implements every hook (``tryfirst``, returning ``None``) and
#: records each call with its arguments. ``HookRecorder(hooks=[...])`` records
#: only those hooks (all are still implemented, so all are still called).
HookRecorder: type[_RecorderBase] = type(
    "HookRecorder",
    (_RecorderBase,),
    {hook: _recording_method(hook) for hook in hook_names()},
)


@contextlib.contextmanager
def registered(loop: Loop, plugin: _Plugin, name: str | None = None) -> Iterator[_Plugin]:
    """Register ``plugin`` on ``loop`` for the ``with`` block only."""
    from .manager import plugin_name

    name = name or plugin_name(plugin)
    loop.plugins.register(plugin, name, "test")
    try:
        yield plugin
    finally:
        loop.plugins.unregister(name)


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state (a test helper, not for training)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_loop(plugins: Iterable[Any] = (), *, n: int = 64, batch_size: int = 8, features: int = 8,
              classes: int = 3, seed: int = 0, accelerator: Any = None, scheduler: bool = True,
              eval_data: bool = False, **loop_kwargs: Any) -> Loop:
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


def tiny_gan_loop(plugins: Iterable[Any] = (), *, n: int = 64, batch_size: int = 16,
                  features: int = 2, latent_dim: int = 4, hidden: int = 16, seed: int = 0,
                  n_critic: int = 1, lr: float = 1e-3, accelerator: Any = None,
                  **loop_kwargs: Any) -> Loop:
    """A seeded :class:`hookloop.strategies.GAN` loop on synthetic data: ``n``
    points of a mixture of 4 Gaussians in ``features`` dimensions, a generator
    MLP ``latent_dim -> features`` and a discriminator MLP ``features -> 1``
    (one logit), both with Adam. Networks are named ``"generator"`` and
    ``"discriminator"``; batches are ``(samples,)`` tuples. The progress bar
    is blocked."""
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    from .loop import Loop
    from .network import Network
    from .strategies import GAN

    set_seed(seed)
    centers = torch.randn(4, features) * 2
    data = centers[torch.randint(0, 4, (n,))] + 0.1 * torch.randn(n, features)

    def mlp(i: int, o: int) -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Linear(i, hidden), torch.nn.LeakyReLU(0.2),
                                   torch.nn.Linear(hidden, o))

    G, D = mlp(latent_dim, features), mlp(features, 1)
    networks = {
        "generator": Network(G, torch.optim.Adam(G.parameters(), lr=lr, betas=(0.5, 0.999))),
        "discriminator": Network(D, torch.optim.Adam(D.parameters(), lr=lr, betas=(0.5, 0.999))),
    }
    train = DataLoader(TensorDataset(data), batch_size=batch_size, shuffle=True)
    loop_kwargs.setdefault("block", ["progress"])
    return Loop(networks=networks, strategy=GAN(latent_dim=latent_dim, n_critic=n_critic),
                train_data=train, plugins=list(plugins), accelerator=accelerator, **loop_kwargs)


def parameters(loop: LoopLike, network: str = "model") -> list[torch.Tensor]:
    """A detached copy of one network's parameters, in ``named_parameters``
    order: compare two runs with ``all(torch.equal(a, b) for a, b in zip(...))``."""
    return [p.detach().clone() for p in loop.networks[network].unwrapped.parameters()]


#: environment variables that decide which installed plugins autoload
_PLUGIN_ENV = ("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "HOOKLOOP_LOAD_PLUGINS", "HOOKLOOP_BLOCK_PLUGINS")


@contextlib.contextmanager
def no_installed_plugins() -> Iterator[None]:
    """Within the block, installed plugins do not autoload and nothing is
    blocked by the environment; plugins named in ``plugins=[...]`` still
    load. The environment is restored afterwards."""
    saved = {k: os.environ.get(k) for k in _PLUGIN_ENV}
    os.environ["HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ.pop("HOOKLOOP_LOAD_PLUGINS", None)
    os.environ.pop("HOOKLOOP_BLOCK_PLUGINS", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- the pytest plugin ------------------------------------------------------


@pytest.fixture
def fresh_accelerator() -> Iterator[None]:
    reset_accelerate()
    yield
    reset_accelerate()


@pytest.fixture
def hookloop_recorder() -> _RecorderBase:
    return HookRecorder()


@pytest.fixture
def isolated_plugins() -> Iterator[None]:
    """No installed plugin autoloads during the test (see :func:`no_installed_plugins`)."""
    with no_installed_plugins():
        yield


@pytest.fixture(name="tiny_loop")
def tiny_loop_fixture(fresh_accelerator: None, isolated_plugins: None) -> Callable[..., Loop]:
    """:func:`tiny_loop`, with fresh Accelerate state and no autoloaded plugins."""
    return tiny_loop


@pytest.fixture(name="tiny_gan_loop")
def tiny_gan_loop_fixture(fresh_accelerator: None, isolated_plugins: None) -> Callable[..., Loop]:
    """:func:`tiny_gan_loop`, with fresh Accelerate state and no autoloaded plugins."""
    return tiny_gan_loop
