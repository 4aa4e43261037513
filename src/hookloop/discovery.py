"""Installed plugins: the entry points of the ``hookloop`` group, and whether
each one may act without being named.

An installed plugin is *listed* without being *active*: installing a
distribution never changes somebody's training by itself. It acts when named
in ``Loop(plugins=[...])``, or, unnamed, when its author declared it an
observer (``autoload = True``, see :func:`autoload_decision`) and the
environment allows it. The environment controls, as in pytest and datasette:

``HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD=1``
    no installed plugin is activated unless named in ``plugins=[...]``.
``HOOKLOOP_LOAD_PLUGINS=a,b``
    only these installed plugins may autoload (set but empty: none).
``HOOKLOOP_BLOCK_PLUGINS=a,b``
    never run these, whatever their source (built-ins included).

Entry points are imported only when asked (:func:`discover`, called when a
``Loop`` is built), and one that fails to import is reported, never fatal to
the others.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from .errors import PluginLoadError
from .markers import ENTRY_POINT_GROUP
from .validation import implemented_hooks

ENV_DISABLE_AUTOLOAD = "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD"
ENV_LOAD = "HOOKLOOP_LOAD_PLUGINS"
ENV_BLOCK = "HOOKLOOP_BLOCK_PLUGINS"


def _env_list(name: str) -> list[str] | None:
    """``None`` when the variable is unset; ``[]`` when set but empty."""
    value = os.environ.get(name)
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def blocked_names(extra: Iterable[str] = ()) -> set[str]:
    return set(_env_list(ENV_BLOCK) or ()) | set(extra)


@dataclass
class Installed:
    """One entry point of the ``hookloop`` group, loaded or not."""

    name: str
    entry_point: metadata.EntryPoint
    distribution: str | None
    version: str | None
    obj: object = None
    error: BaseException | None = None
    hooks: list[str] = field(default_factory=list)

    @property
    def autoload(self) -> bool:
        """Whether the author declared the plugin an observer that may act
        as soon as it is installed (``autoload = True`` on the object)."""
        return bool(getattr(self.obj, "autoload", False))

    @property
    def changes_training(self) -> bool | None:
        """What the author declared (see :func:`changes_training`)."""
        return changes_training(self.obj)

    def describe(self) -> str:
        dist = f"{self.distribution} {self.version}" if self.distribution else "?"
        return f"entry point {self.name!r} ({self.entry_point.value}) of distribution {dist}"

    def instantiate(self, options: Mapping[str, Any] | None = None) -> Any:
        """The plugin object to register: a class is called with ``options``,
        a module or an instance is used as it is."""
        if self.error is not None:
            raise PluginLoadError(
                f"cannot load installed plugin {self.name!r}: "
                f"{self.describe()} failed to import: "
                f"{type(self.error).__name__}: {self.error}",
                distribution=self.distribution,
                entry_point=self.entry_point.value,
            ) from self.error
        if inspect.isclass(self.obj):
            try:
                return self.obj(**(options or {}))
            except TypeError as exc:
                raise PluginLoadError(
                    f"cannot create installed plugin {self.name!r} "
                    f"({self.describe()}) with options {options or {}}: {exc}",
                    distribution=self.distribution,
                    entry_point=self.entry_point.value,
                ) from exc
        if options:
            raise PluginLoadError(
                f"installed plugin {self.name!r} ({self.describe()}) is not a "
                f"class and takes no options; got {options}",
                distribution=self.distribution,
                entry_point=self.entry_point.value,
            )
        return self.obj


def discover() -> list[Installed]:
    """Every entry point of the ``hookloop`` group, imported but not
    registered. A distribution that fails to import is returned with its
    ``error`` set: it does not take the others down."""
    found = []
    seen = set()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        key = (ep.name, ep.value)
        if key in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add(key)
        item = Installed(
            name=ep.name,
            entry_point=ep,
            distribution=dist.metadata["Name"] if dist else None,
            version=dist.version if dist else None,
        )
        try:
            item.obj = ep.load()
        except Exception as exc:  # noqa: BLE001 - reported, never fatal here
            item.error = exc
        else:
            item.hooks = implemented_hooks(item.obj)
        found.append(item)
    return found


def changes_training(plugin: object) -> bool | None:
    """Whether a plugin (object or class) changes the numbers of a training
    run (loss, gradients, weights, data, stopping), as its author declared
    with a ``changes_training`` attribute: ``True``, ``False``, or ``None``
    when undeclared. ``autoload = True`` without it declares an observer
    (``False``). ``hookloop plugins`` shows it."""
    declared = getattr(plugin, "changes_training", None)
    if isinstance(declared, bool):
        return declared
    return False if getattr(plugin, "autoload", False) is True else None


def autoload_considered(name: str, block: Iterable[str] = ()) -> bool:
    """Whether the environment lets an installed plugin of this name autoload
    at all (before looking at the plugin itself)."""
    if name in blocked_names(block) or os.environ.get(ENV_DISABLE_AUTOLOAD):
        return False
    allow = _env_list(ENV_LOAD)
    return allow is None or name in allow


def autoload_decision(item: Installed, block: Iterable[str] = ()) -> tuple[bool, str]:
    """Whether an installed plugin activates without being named, and why."""
    if item.name in blocked_names(block):
        return False, "blocked by name"
    if item.error is not None:
        return False, f"failed to import: {type(item.error).__name__}: {item.error}"
    if os.environ.get(ENV_DISABLE_AUTOLOAD):
        return False, f"{ENV_DISABLE_AUTOLOAD} is set; name it in plugins=[...] to use it"
    allow = _env_list(ENV_LOAD)
    if allow is not None and item.name not in allow:
        return False, f"not in {ENV_LOAD}; name it in plugins=[...] to use it"
    changes = item.changes_training
    if not item.autoload:
        if changes is False:
            return False, ("observer (changes_training = False), but its author did not set "
                           "autoload = True: acts only when named in plugins=[...]")
        if changes is None:
            return False, ("acts only when named in plugins=[...] (its author declared neither "
                           "autoload nor changes_training)")
        return False, "changes training: acts only when named in plugins=[...]"
    if changes:
        return False, ("declares autoload = True and changes_training = True: a plugin that "
                       "changes training never autoloads; name it in plugins=[...]")
    return True, "observer: its author set autoload = True"


def warn_broken(item: Installed) -> None:
    warnings.warn(
        f"hookloop: skipping installed plugin {item.name!r}: {item.describe()} "
        f"failed to import: {type(item.error).__name__}: {item.error}",
        RuntimeWarning,
        stacklevel=3,
    )
