"""What a hook implementation sees of the loop, as a type: :class:`LoopLike`.

The hook specifications (:mod:`hookloop.hookspecs`) annotate their ``loop``
argument with this protocol rather than with :class:`hookloop.Loop` itself:
``loop.py`` imports the plugin manager, which imports the specifications, so
naming ``Loop`` there, even under ``TYPE_CHECKING``, would close an import
cycle (``tests/test_package.py`` counts every import statement). This module
imports only leaves (the run state, ``Network``), so the specifications can.

:class:`hookloop.Loop` satisfies :class:`LoopLike` structurally (checked by
``mypy`` in ``tests/test_types.py``); a plugin annotates its hook
implementations with ``Loop`` as before::

    @hookimpl
    def after_step(self, loop: Loop) -> None:
        if loop.state.global_step % 10 == 0: ...

Only the plugin-facing part of ``Loop`` is declared here; a name added to it
for plugins belongs here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from .network import Network
from .state import LoopState


class PluginsLike(Protocol):
    """``loop.plugins`` as a plugin uses it (:class:`hookloop.manager.PluginManager`)."""

    @property
    def sources(self) -> dict[str, str]: ...

    def names(self) -> list[str]: ...

    def get(self, name: str) -> Any: ...

    def name_of(self, plugin: object) -> str | None: ...


class LoopLike(Protocol):
    """The plugin-facing attributes and methods of :class:`hookloop.Loop`
    (read-only here: a plugin reads ``loop.state``, it does not replace it)."""

    @property
    def state(self) -> LoopState: ...

    @property
    def accelerator(self) -> Any: ...

    @property
    def networks(self) -> Mapping[str, Network]: ...

    @property
    def strategy(self) -> Any: ...

    @property
    def train_data(self) -> Any: ...

    @property
    def eval_data(self) -> Any: ...

    @property
    def plugins(self) -> PluginsLike: ...

    @property
    def hook(self) -> Any: ...

    @property
    def configured_accumulation(self) -> int: ...

    @property
    def accumulating(self) -> bool: ...

    @property
    def fastpath(self) -> Any: ...

    @property
    def resumed_from(self) -> Path | None: ...

    @property
    def at_safe_point(self) -> bool: ...

    @property
    def total_steps(self) -> int | None: ...

    def print(self, *args: Any, **kwargs: Any) -> None: ...

    def stop(self, reason: str | None = None, *, every_rank: bool = False) -> None: ...

    def skip_batch(self) -> None: ...

    def discard_update(self) -> None: ...

    @property
    def discarded_updates(self) -> int: ...

    def end_epoch(self, *, every_rank: bool = False) -> None: ...

    def log(self, values: Mapping[str, Any], *, on_step: bool = True, on_epoch: bool = False,
            reduce: str = "mean") -> None: ...

    def log_images(self, images: Mapping[str, Any]) -> None: ...

    def start_trackers(self, project_name: str = "hookloop", config: dict[str, Any] | None = None,
                       init_kwargs: dict[str, Any] | None = None) -> bool: ...

    def accumulate(self, *models: Any) -> contextlib.AbstractContextManager[Any]: ...

    def evaluate(self, data: Any = None) -> dict[str, Any]: ...

    def predict(self, data: Any, *, pad_index: float | None = -100) -> Any: ...
