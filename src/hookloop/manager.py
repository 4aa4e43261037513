"""The plugin manager: which plugins a loop runs, in which order, and why.

Three sources, called in this order for every hook (pluggy calls the
last-registered first, so they are registered in the reverse order):

1. plugins given in code, ``Loop(plugins=[A, B])``: A, then B;
2. installed plugins (entry-point group ``hookloop``) that are switched on:
   named in ``plugins=[...]``, or observers whose author set ``autoload``
   (:mod:`hookloop.discovery`, with the environment controls);
3. built-in plugins: the strategy, its default loss, the progress bar.

pluggy calls ``trylast`` implementations in the order they were registered,
the others in the reverse order; so the built-ins with a ``trylast``
implementation (the strategy's ``training_step`` and ``eval_step``, the
default loss, the default metrics) are registered after the plugins, and
pluggy calls the built-in defaults after every plugin's implementation,
``trylast`` ones included (:func:`trylast_in_registration_order`). Only
pluggy's public API decides the order. Every plugin is checked before it is
registered (:mod:`hookloop.validation`); ``loop.hook`` calls the hooks
(:mod:`hookloop.relay`); an exception is traced back to the plugin and hook
it came from (:meth:`PluginManager.culprit`). ``HOOKLOOP_TRACE=1`` prints
every hook call and its implementations to stderr.

The names other modules import from here keep working: the ones now in
:mod:`hookloop.discovery`, :mod:`hookloop.validation` and
:mod:`hookloop.relay` are imported below.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from .discovery import (  # noqa: F401 - hookloop.manager's names, as before
    ENV_BLOCK,
    ENV_DISABLE_AUTOLOAD,
    ENV_LOAD,
    Installed,
    autoload_considered,
    autoload_decision,
    blocked_names,
    changes_training,
    discover,
    warn_broken,
)
from .errors import PluginLoadError, PluginValidationError, add_note
from .markers import PROJECT_NAME
from .relay import HookRelay
from .validation import (  # noqa: F401 - hookloop.manager's names, as before
    FOREIGN_HOOKS,
    UnmarkedHookWarning,
    _spec_args,
    hook_names,
    implemented_hooks,
    suggest_hook,
    validate,
)

if TYPE_CHECKING:
    from pluggy import HookImpl

    from .protocols import LoopLike

ENV_TRACE = "HOOKLOOP_TRACE"

#: hookloop.manager's names: its own, and the ones now in discovery and validation
__all__ = [
    "ENV_BLOCK", "ENV_DISABLE_AUTOLOAD", "ENV_LOAD", "ENV_TRACE", "FOREIGN_HOOKS", "Installed",
    "PluginManager", "UnmarkedHookWarning", "_spec_args", "autoload_considered",
    "autoload_decision", "blocked_names", "changes_training", "discover", "explicit_name",
    "hook_names", "implemented_hooks", "name_instances", "plugin_name", "resolve_named",
    "suggest_hook", "validate", "warn_broken",
]

#: one plugin as the naming takes it: (plugin, explicit name or None, base name, source)
Entry = tuple[Any, "str | None", str, str]


@functools.cache
def trylast_in_registration_order() -> bool:
    """Whether pluggy calls the ``trylast`` implementations of a hook in the
    order they were registered, the first registered first, as pluggy 1.7's
    code does; the other implementations it calls last registered first (its
    documentation says that of ``trylast`` ones too). Asked once per
    process, of a pluggy manager of its own, with public API only.

    :meth:`PluginManager.register_all` registers the built-ins with a
    ``trylast`` implementation after the plugins when it is true, and with
    the others (before the plugins) when it is not: either way pluggy calls
    the built-in defaults after every plugin."""
    probe = pluggy.PluginManager(_ORDER_PROBE)
    probe.add_hookspecs(_OrderProbeSpec)
    probe.register(_OrderProbe("first"), name="first")
    probe.register(_OrderProbe("second"), name="second")
    return bool(probe.hook.order_probe() == ["first", "second"])


_ORDER_PROBE = "hookloop-order-probe"


class _OrderProbeSpec:
    @pluggy.HookspecMarker(_ORDER_PROBE)
    def order_probe(self) -> str | None:
        """A hook whose implementations say who was called first."""


class _OrderProbe:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    @pluggy.HookimplMarker(_ORDER_PROBE)(trylast=True)
    def order_probe(self) -> str:
        return self.tag


class PluginManager:
    """pluggy's manager plus validation, ordering, names and attribution."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        #: name -> where it came from ("built-in", "code", or an entry point)
        self.sources: dict[str, str] = {}
        #: the built-ins registered after the plugins (see :meth:`register_all`),
        #: in registration order: registered again after a plugin added later
        self._late: list[tuple[Any, str]] = []
        #: (key, default, plugin) of the keys a default built-in gave way on (said once each)
        self.gave_way: set[tuple[str, str, str]] = set()
        self._guarding = False  # inside guard(): only the outermost acts
        self.hook = HookRelay(self.pm)
        if os.environ.get(ENV_TRACE):
            self._enable_tracing()

    def register(self, plugin: object, name: str, source: str) -> None:
        """Check and register one plugin (a loop's plugins are registered by
        :meth:`register_all`). The built-ins registered after the plugins are
        registered again after it, so its ``trylast`` implementations, too,
        run before the built-in defaults'."""
        self._add(plugin, name, source)
        for late, late_name in self._late:  # after the new plugin again: see register_all
            if self.pm.get_plugin(late_name) is late:
                self.pm.unregister(late)
                self.pm.register(late, name=late_name)
        self.refresh()

    def _add(self, plugin: object, name: str, source: str) -> None:
        if self.pm.is_registered(plugin):  # before validation: its warnings were given once
            raise PluginValidationError(
                plugin,
                f"plugin {name!r} is given twice (the same object): from "
                f"{self.sources.get(self.pm.get_name(plugin) or '', '?')} and from {source}. "
                "Give it once, or make a second instance.",
            )
        validate(plugin, name)
        if self.pm.has_plugin(name):
            other = self.sources.get(name, "?")
            where = (f"both from {source}" if other == source
                     else f"one from {other}, one from {source}")
            raise PluginValidationError(
                plugin,
                f"two plugins are named {name!r}: {where}. Give one a different "
                "`name` attribute.",
            )
        self.pm.register(plugin, name=name)
        self.sources[name] = source

    def register_all(self, given: Iterable[Any], *, strategy: Any, defaults: Sequence[object],
                     builtins: Mapping[str, Any], block: Iterable[str] = ()) -> None:
        """Register a loop's plugins so that calls go: ``given`` (in order),
        switched-on installed plugins, then the built-ins (``strategy``
        first, then its ``defaults``). pluggy calls the last registered
        first, hence the reversed registration.

        pluggy calls ``trylast`` implementations the other way round, the
        first registered first (:func:`trylast_in_registration_order`). So
        the built-ins that have one (the strategy's ``training_step`` and
        ``eval_step``, the default loss, the default metrics) are registered
        after the plugins, in reverse: pluggy then calls their ``trylast``
        implementations after every plugin's (among themselves in the order
        they had: track-metrics', the metrics', the loss', the strategy's),
        and a built-in default answers a *firstresult* hook only when no
        plugin did. Their implementations of other kinds run before the
        plugins' of the same kind (the GAN strategy's checks at
        ``on_fit_start``). No private of pluggy is needed, so
        ``HOOKLOOP_PLUGGY_PRIVATES=0`` gives the same order. With a pluggy
        that calls ``trylast`` implementations last registered first, the
        built-ins are all registered before the plugins, with the same effect.

        :param given: ``Loop(plugins=[...])``: objects, names of built-in or
            installed plugins, ``(name, {options})`` pairs.
        :param builtins: the built-in plugins by name (``"logger"`` ->
            class), for plugins given by name.
        :param block: names never to register (with ``HOOKLOOP_BLOCK_PLUGINS``).
        """
        blocked = blocked_names(block)
        if strategy.name in blocked:
            raise PluginValidationError(strategy, f"the strategy {strategy.name!r} cannot be blocked")
        installed: dict[str, Installed] | None = None
        user: list[Entry] = []
        for i, item in enumerate(given):
            if isinstance(item, (str, tuple)):
                if installed is None:
                    installed = {i.name: i for i in discover()}
                plugin, source, explicit, base = resolve_named(item, installed, builtins)
            else:
                plugin, source, explicit = item, "code", explicit_name(item)
                base = plugin_name(item)
            user.append((plugin, explicit, base, f"{source}, plugins[{i}]"))
        named = name_instances(user)
        user_names = {name for _, name, _ in named}
        if installed is None and not os.environ.get(ENV_DISABLE_AUTOLOAD):
            installed = {i.name: i for i in discover()}
        auto: list[tuple[Any, str, str]] = []
        for item in (installed or {}).values():
            if item.name in user_names or not autoload_considered(item.name, block):
                continue
            if item.error is not None:  # one broken distribution does not stop the others
                warn_broken(item)
            elif autoload_decision(item, block)[0]:
                auto.append((item.instantiate(), item.name, item.describe()))
        # a plugin may bring the built-ins it works with (``hookloop_plugins``,
        # as pytest's ``pytest_plugins``): defaults, unless given or blocked
        brought = {name: builtins[name] for p, *_ in [*named, *auto]
                   for name in getattr(p, "hookloop_plugins", ()) if name in builtins}
        defaults = [*defaults, *(cls() for name, cls in brought.items()
                                 if name not in user_names and name not in {plugin_name(d) for d in defaults})]
        builtin = [(p, plugin_name(p), "built-in") for p in [strategy, *defaults]]
        builtin = [b for b in builtin if b[1] not in user_names or b[0] is strategy]
        late = ([b for b in builtin if b[1] not in blocked and self._has_trylast(b[0])]
                if trylast_in_registration_order() else [])
        early = [b for b in builtin if not any(b[0] is p for p, _, _ in late)]
        for plugin, name, source in [*early, *reversed(auto), *reversed(named), *reversed(late)]:
            if name in blocked:
                continue
            self._add(plugin, name, source)
        self._late = [(plugin, name) for plugin, name, _ in reversed(late)]
        self.refresh()

    def _has_trylast(self, plugin: object) -> bool:
        """Whether pluggy would register a ``trylast`` implementation of ``plugin``."""
        for attr in dir(plugin):
            try:
                opts = self.pm.parse_hookimpl_opts(plugin, attr)
            except Exception:  # noqa: BLE001 - validation names it when the plugin is registered
                continue
            if opts and opts.get("trylast"):
                return True
        return False

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.sources.pop(name, None)
        self._late = [(plugin, late) for plugin, late in self._late if late != name]
        self.refresh()

    def refresh(self) -> None:
        """Rebuild ``hook`` (the relay caches each hook's callers): call it
        after changing implementations or adding call monitoring by hand."""
        self.hook = HookRelay(self.pm)

    def add_hookcall_monitoring(self, before: Callable[..., None],
                                after: Callable[..., None]) -> Callable[[], None]:
        """pluggy's ``add_hookcall_monitoring``, then :meth:`refresh`, so
        that the monitoring sees every call. Returns the undo function."""
        undo = self.pm.add_hookcall_monitoring(before, after)
        self.refresh()

        def undo_and_refresh() -> None:
            undo()
            self.refresh()

        return undo_and_refresh

    def names(self) -> list[str]:
        return [name for name, plugin in self.pm.list_name_plugin() if plugin is not None]

    def get(self, name: str) -> Any:
        return self.pm.get_plugin(name)

    def name_of(self, plugin: object) -> str | None:
        """The name ``plugin`` (the object) is registered under (``"logger"``,
        ``"logger-2"``, a name of its own), or None if it is not registered.
        A plugin with several instances names what it logs with it::

            loop.log({f"{loop.plugins.name_of(self)}/clip_fraction": fraction})
        """
        try:
            return self.pm.get_name(plugin)
        except (TypeError, ValueError):  # unhashable, or not registered
            return None

    @contextlib.contextmanager
    def guard(self, loop: LoopLike) -> Iterator[None]:
        """Call ``on_exception`` for anything that escapes the block, and name
        the plugin and hook an exception came out of in a note on the
        exception (``except ValueError`` around ``fit`` still catches a
        model's ``ValueError``). Only the outermost guard (``fit``, or a lone
        ``evaluate`` / ``predict``) acts."""
        if self._guarding:
            yield
            return
        self._guarding = True
        try:
            yield
        except BaseException as exc:
            try:
                self.hook.on_exception(loop=loop, exception=exc)
            except Exception as hook_exc:  # keep the original error first
                exc.__context__ = hook_exc
            culprit = self.culprit(exc) if isinstance(exc, Exception) else None
            collective = _collective_failure(loop, exc)
            if culprit is not None:
                plugin, hook = culprit
                verb = "surfaced" if collective else "raised"
                add_note(exc, f"hookloop: {verb} in hook {hook!r} of plugin {plugin!r} "
                              f"({self.sources.get(plugin, '?')})")
            if collective:
                add_note(exc, "hookloop: a collective (all-reduce, gather, broadcast) failed between "
                              f"the {loop.accelerator.num_processes} processes: they may have run "
                              "different collectives. Every process must run the same ones in the "
                              "same order: a plugin's accelerator.reduce / gather / broadcast, "
                              "loop.log(on_epoch=True) or loop.evaluate() run on some processes only "
                              "(under `if accelerator.is_main_process:`) makes them disagree; where it "
                              "surfaced is not where it went wrong")
            raise  # the same exception object, its type and traceback unchanged
        finally:
            self._guarding = False

    def culprit(self, exc: BaseException) -> tuple[str, str] | None:
        """Which plugin and hook an exception came out of: the innermost
        traceback frame that runs a registered hook implementation.

        Costs nothing until something raises (no per-call wrapping). An
        exception that carries ``hookloop_culprit = (plugin, hook)`` (set by
        code that found the culprit itself, e.g. a strategy refusing what a
        ``compute_loss`` plugin returned) names that plugin instead."""
        preset = getattr(exc, "hookloop_culprit", None)
        if isinstance(preset, tuple) and len(preset) == 2:
            return preset
        by_code: dict[Any, list[tuple[HookImpl, str]]] = {}
        for hook in hook_names():
            for impl in getattr(self.pm.hook, hook).get_hookimpls():
                code = getattr(impl.function, "__code__", None)
                if code is not None:
                    by_code.setdefault(code, []).append((impl, hook))
        found = None
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            candidates = by_code.get(frame.f_code)
            if candidates:
                owner = frame.f_locals.get("self")
                match = next(
                    (c for c in candidates if getattr(c[0].function, "__self__", None) is owner),
                    candidates[0],
                )
                found = (match[0].plugin_name, match[1])
            tb = tb.tb_next
        return found

    def _enable_tracing(self) -> None:
        def before(hook_name: str, hook_impls: Sequence[HookImpl], kwargs: Mapping[str, Any]) -> None:
            names = ", ".join(impl.plugin_name for impl in hook_impls)
            print(f"[hookloop] {hook_name} -> {names}", file=sys.stderr)

        def after(outcome: Any, hook_name: str, hook_impls: Sequence[HookImpl],
                  kwargs: Mapping[str, Any]) -> None:
            pass

        self.add_hookcall_monitoring(before, after)


# ---------------------------------------------------------------------------
# naming: which name each plugin of a loop is registered under
# ---------------------------------------------------------------------------


#: what torch.distributed's backends say when the processes ran other collectives
_COLLECTIVE_SIGNS = ("collective mismatch", "doesn't match expected size", "op.preamble",
                     "Connection closed by peer", "Connection reset by peer", "ProcessGroupGloo",
                     "ProcessGroupNCCL", "NCCL error", "Watchdog caught collective")


def _collective_failure(loop: LoopLike, exc: BaseException) -> bool:
    """Whether ``exc`` looks like processes that disagreed on a collective."""
    try:
        several = loop.accelerator.num_processes > 1
    except Exception:  # noqa: BLE001 - a half-built loop
        return False
    if not several or not isinstance(exc, (RuntimeError, OSError)):
        return False
    text = str(exc)
    return any(sign in text for sign in _COLLECTIVE_SIGNS) or "DistBackendError" in type(exc).__name__


def plugin_name(plugin: Any) -> str:
    """A plugin's name: its ``name`` attribute, else its class (or module) name.
    A class given instead of an instance is named after itself (``GradClip``,
    not ``type``), so that the error refusing it names it."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str) and name:
        return name
    if inspect.ismodule(plugin) or inspect.isclass(plugin):
        return str(plugin.__name__)
    return type(plugin).__name__


def explicit_name(plugin: Any) -> str | None:
    """The name a plugin object was given itself (an instance attribute
    ``name``, a module's name), or None: then it is named after its class,
    and several instances are told apart by number."""
    if inspect.ismodule(plugin):
        return plugin.__name__
    name = vars(plugin).get("name") if hasattr(plugin, "__dict__") else None
    return name if isinstance(name, str) and name else None


def name_instances(entries: Sequence[Entry]) -> list[tuple[Any, str, str]]:
    """``(plugin, explicit name or None, base name, source)`` ->
    ``(plugin, name, source)``.

    Explicit names are kept (two alike are an error at registration, naming
    both). A plugin without one takes its class's name (``Logger``:
    ``"logger"``); the next instance of that name becomes ``"logger-2"``,
    then ``"logger-3"``: deterministic, so the same script gives the same
    names and a checkpoint's plugin states find their plugins again."""
    taken = {explicit for _, explicit, _, _ in entries if explicit is not None}
    out: list[tuple[Any, str, str]] = []
    for plugin, explicit, base, source in entries:
        name = explicit
        if name is None:
            name, n = base, 1
            while name in taken:
                n += 1
                name = f"{base}-{n}"
            taken.add(name)
        out.append((plugin, name, source))
    return out


def resolve_named(item: Any, installed: Mapping[str, Installed],
                  builtins: Mapping[str, Any]) -> tuple[Any, str, str | None, str]:
    """A plugin given by name (a built-in of ``builtins``, name -> class, or
    an installed one): ``(plugin, source, explicit name or None, base name)``.
    ``("logger", {"name": "fast", "every": 2})``: the option ``name`` names
    the instance (and is passed on only to a class that takes ``name``)."""
    name, options = (item, None) if isinstance(item, str) else item
    if inspect.isclass(name):  # (GradClip, {...}): the class, named as itself
        cls = name.__qualname__
        args = (", ".join(f"{k}={v!r}" for k, v in options.items())
                if isinstance(options, Mapping) and all(isinstance(k, str) for k in options) else "...")
        raise PluginValidationError(
            item, f"plugin given as ({cls}, {options!r}): a (name, options) pair takes the "
                  f"plugin's name, not its class: pass the instance {cls}({args})"
        )
    if not isinstance(name, str) or (options is not None and not isinstance(options, Mapping)):
        raise PluginValidationError(
            item, f"plugin given as {item!r}: expected 'name' or ('name', {{options}})"
        )
    options = dict(options or {})
    given = options.get("name")
    if given is not None and not (isinstance(given, str) and given):
        raise PluginValidationError(item, f"plugin {name!r}: option 'name' must be a non-empty str, got {given!r}")
    if name in builtins:
        cls = builtins[name]
        if given is not None and "name" not in inspect.signature(cls).parameters:
            del options["name"]
        try:
            plugin = cls(**options)
        except TypeError as exc:
            raise PluginValidationError(
                item, f"built-in plugin {name!r} cannot be created with {options}: {exc}"
            ) from exc
        return plugin, "built-in", given, plugin_name(plugin)
    if name in installed:
        entry = installed[name]
        if given is not None and not (inspect.isclass(entry.obj)
                                      and "name" in inspect.signature(entry.obj).parameters):
            del options["name"]
        plugin = entry.instantiate(options or None)
        # numbered after the entry-point name, the one users see
        return plugin, entry.describe(), given or explicit_name(plugin), name
    known = sorted(set(builtins) | set(installed))
    raise PluginLoadError(
        f"no plugin named {name!r}: not built in and not installed "
        f"(entry-point group 'hookloop'). Known: {', '.join(known)}"
    )
