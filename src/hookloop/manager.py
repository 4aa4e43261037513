"""The plugin manager: which plugins a loop runs, in which order, and why.

Three sources, called in this order for every hook (pluggy calls the
last-registered first, so they are registered in the reverse order):

1. plugins given in code, ``Loop(plugins=[A, B])``: A, then B;
2. installed plugins (entry-point group ``hookloop``) that are switched on:
   named in ``plugins=[...]``, or observers whose author set ``autoload``;
3. built-in plugins: the strategy, its default loss, the progress bar.

An installed plugin is *listed* without being *active*: installing a
distribution never changes somebody's training by itself (see
:func:`discover`). Environment controls, as in pytest and datasette:

``HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD=1``
    no installed plugin is activated unless named in ``plugins=[...]``.
``HOOKLOOP_LOAD_PLUGINS=a,b``
    only these installed plugins may autoload (set but empty: none).
``HOOKLOOP_BLOCK_PLUGINS=a,b``
    never run these, whatever their source (built-ins included).
``HOOKLOOP_TRACE=1``
    print every hook call and its implementations to stderr.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata

import pluggy
from pluggy._callers import _multicall
from pluggy._hooks import varnames

from . import hookspecs
from .errors import PluginLoadError, PluginValidationError
from .markers import ENTRY_POINT_GROUP, PROJECT_NAME

ENV_DISABLE_AUTOLOAD = "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD"
ENV_LOAD = "HOOKLOOP_LOAD_PLUGINS"
ENV_BLOCK = "HOOKLOOP_BLOCK_PLUGINS"
ENV_TRACE = "HOOKLOOP_TRACE"


class UnmarkedHookWarning(UserWarning):
    """A plugin marks some hook methods ``@hookimpl`` but leaves one that is
    named like a hook unmarked: that one is never called."""


@functools.cache
def hook_names() -> tuple[str, ...]:
    """Every hook, in the order ``hookspecs.py`` declares them."""
    return tuple(
        name
        for name, func in vars(hookspecs).items()
        if inspect.isfunction(func) and hasattr(func, PROJECT_NAME + "_spec")
    )


def _env_list(name: str) -> list[str] | None:
    """``None`` when the variable is unset; ``[]`` when set but empty."""
    value = os.environ.get(name)
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def blocked_names(extra=()) -> set[str]:
    return set(_env_list(ENV_BLOCK) or ()) | set(extra)


def plugin_name(plugin) -> str:
    """A plugin's name: its ``name`` attribute, else its class (or module) name."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str) and name:
        return name
    if inspect.ismodule(plugin):
        return plugin.__name__
    return type(plugin).__name__


# ---------------------------------------------------------------------------
# installed plugins
# ---------------------------------------------------------------------------


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

    def instantiate(self, options=None):
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


def changes_training(plugin) -> bool | None:
    """Whether a plugin (object or class) changes the numbers of a training
    run (loss, gradients, weights, data, stopping), as its author declared
    with a ``changes_training`` attribute: ``True``, ``False``, or ``None``
    when undeclared. ``autoload = True`` without it declares an observer
    (``False``). ``hookloop plugins`` shows it."""
    declared = getattr(plugin, "changes_training", None)
    if isinstance(declared, bool):
        return declared
    return False if getattr(plugin, "autoload", False) is True else None


def autoload_considered(name: str, block=()) -> bool:
    """Whether the environment lets an installed plugin of this name autoload
    at all (before looking at the plugin itself)."""
    if name in blocked_names(block) or os.environ.get(ENV_DISABLE_AUTOLOAD):
        return False
    allow = _env_list(ENV_LOAD)
    return allow is None or name in allow


def autoload_decision(item: Installed, block=()) -> tuple[bool, str]:
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


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def _spec_args(name: str) -> tuple[str, ...]:
    return varnames(getattr(hookspecs, name))[0]


def implemented_hooks(plugin) -> list[str]:
    """The hook names a plugin object marks with ``@hookimpl``."""
    if inspect.isclass(plugin):  # look at the methods without instantiating
        candidates = {n: getattr(plugin, n, None) for n in dir(plugin)}
    else:
        candidates = {n: getattr(plugin, n, None) for n in dir(plugin) if not n.startswith("__")}
    out = []
    for attr, value in candidates.items():
        opts = getattr(value, PROJECT_NAME + "_impl", None)
        if isinstance(opts, dict):
            out.append(opts.get("specname") or attr)
    order = {h: i for i, h in enumerate(hook_names())}
    return sorted(out, key=lambda h: order.get(h, len(order)))


#: hook names of other training libraries -> the hookloop hook that does that
#: job (used by the "did you mean" of a misnamed hook). Lightning's
#: ``Callback`` / ``LightningModule`` hooks and the Hugging Face Trainer's
#: ``TrainerCallback`` events; names hookloop shares (``on_fit_start``,
#: ``on_exception``, ``on_train_epoch_end``) need no entry.
FOREIGN_HOOKS = {
    # Lightning
    "setup": ("Lightning", "on_fit_start"),
    "on_train_start": ("Lightning", "on_fit_start"),
    "on_train_end": ("Lightning", "on_fit_end"),
    "teardown": ("Lightning", "on_fit_end"),
    "on_train_epoch_start": ("Lightning", "on_epoch_start"),
    "training_epoch_end": ("Lightning", "on_train_epoch_end"),
    "on_train_batch_start": ("Lightning", "before_step"),
    "on_train_batch_end": ("Lightning", "after_step"),
    "training_step_end": ("Lightning", "after_step"),
    "on_before_backward": ("Lightning", "before_backward"),
    "on_after_backward": ("Lightning", "after_backward"),
    "on_before_optimizer_step": ("Lightning", "before_optimizer_step"),
    "optimizer_step": ("Lightning", "before_optimizer_step"),
    "on_before_zero_grad": ("Lightning", "before_zero_grad"),
    "optimizer_zero_grad": ("Lightning", "before_zero_grad"),
    "lr_scheduler_step": ("Lightning", "before_scheduler_step"),
    "on_validation_start": ("Lightning", "on_eval_start"),
    "on_validation_epoch_start": ("Lightning", "on_eval_start"),
    "validation_step": ("Lightning", "eval_step"),
    "on_validation_batch_end": ("Lightning", "after_eval_step"),
    "validation_step_end": ("Lightning", "after_eval_step"),
    "on_validation_epoch_end": ("Lightning", "on_eval_end"),
    "validation_epoch_end": ("Lightning", "on_eval_end"),
    "on_validation_end": ("Lightning", "on_eval_end"),
    "test_step": ("Lightning", "eval_step"),
    "on_test_batch_end": ("Lightning", "after_eval_step"),
    "on_test_epoch_end": ("Lightning", "on_eval_end"),
    "on_save_checkpoint": ("Lightning", "state_dict"),
    "on_load_checkpoint": ("Lightning", "load_state_dict"),
    # Hugging Face Trainer callbacks
    "on_init_end": ("the Hugging Face Trainer", "on_fit_start"),
    "on_train_begin": ("the Hugging Face Trainer", "on_fit_start"),
    "on_epoch_begin": ("the Hugging Face Trainer", "on_epoch_start"),
    "on_step_begin": ("the Hugging Face Trainer", "before_step"),
    "on_pre_optimizer_step": ("the Hugging Face Trainer", "before_optimizer_step"),
    "on_optimizer_step": ("the Hugging Face Trainer", "after_optimizer_step"),
    "on_substep_end": ("the Hugging Face Trainer", "after_step"),
    "on_step_end": ("the Hugging Face Trainer", "after_step"),
    "on_evaluate": ("the Hugging Face Trainer", "on_eval_end"),
    "on_prediction_step": ("the Hugging Face Trainer", "after_eval_step"),
    "on_log": ("the Hugging Face Trainer", "after_step"),
    "on_save": ("the Hugging Face Trainer", "state_dict"),
}

#: plugin methods that are not hooks (the checkpoint plugin calls them)
_STATE_METHODS = ("state_dict", "load_state_dict")


def suggest_hook(hook: str, valid=None) -> str:
    """A hint for a method marked ``@hookimpl`` whose name is no hookloop
    hook: the hook that does the job when the name is another library's (see
    :data:`FOREIGN_HOOKS`), else the closest hook name; ``""`` if none."""
    valid = hook_names() if valid is None else valid
    foreign = FOREIGN_HOOKS.get(hook)
    if foreign is not None:
        library, target = foreign
        if target in _STATE_METHODS:
            return (
                f" {hook!r} is {library}'s name; in hookloop a plugin keeps state in "
                "checkpoints with plain (unmarked) state_dict() and load_state_dict(state) methods."
            )
        if target in valid:
            return f" {hook!r} is {library}'s name: the hookloop hook is {target!r}."
    close = difflib.get_close_matches(hook, valid, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def validate(plugin, name: str) -> None:
    """Raise :class:`PluginValidationError`, naming the plugin, the method and
    the valid choices, for anything pluggy would accept silently or report
    only at call time."""
    if inspect.isclass(plugin):
        raise PluginValidationError(
            plugin,
            f"plugin {name!r} is the class {plugin.__module__}.{plugin.__qualname__}, "
            f"not an instance: pass {plugin.__qualname__}(...) instead",
        )
    valid = hook_names()
    marked = 0
    implemented = set()
    for attr in dir(plugin):
        if attr.startswith("__"):
            continue
        method = getattr(plugin, attr, None)
        opts = getattr(method, PROJECT_NAME + "_impl", None)
        if not isinstance(opts, dict):
            continue
        marked += 1
        hook = opts.get("specname") or attr
        implemented.add(hook)
        if hook not in valid:
            raise PluginValidationError(
                plugin,
                f"plugin {name!r}: method {attr!r} is marked @hookimpl but "
                f"{hook!r} is not a hookloop hook.{suggest_hook(hook, valid)} "
                f"Valid hooks: {', '.join(valid)}",
            )
        _check_signature(plugin, name, attr, hook, method)
        if (opts.get("wrapper") or opts.get("hookwrapper")) and not inspect.isgeneratorfunction(method):
            kind = "wrapper=True" if opts.get("wrapper") else "hookwrapper=True"
            raise PluginValidationError(
                plugin,
                f"plugin {name!r}: method {attr!r} (hook {hook!r}) is marked "
                f"@hookimpl({kind}) but has no `yield`: a wrapper runs its code before "
                "`result = yield`, the other implementations at the yield, and returns "
                "the result after it. Add the yield, or drop the wrapper option.",
            )
        args = varnames(method)[0]
        spec_args = _spec_args(hook)
        unknown = [a for a in args if a not in spec_args]
        if unknown:
            raise PluginValidationError(
                plugin,
                f"plugin {name!r}: method {attr!r} (hook {hook!r}) asks for "
                f"argument(s) {', '.join(map(repr, unknown))} that the hook does "
                f"not have. Valid arguments: {', '.join(spec_args)}",
            )
    lookalikes = [a for a in dir(plugin) if a in valid and a not in implemented
                  and callable(getattr(plugin, a, None))]
    if marked == 0:
        hint = (
            f" Methods named like hooks but not marked: {', '.join(lookalikes)} "
            f"(add @hookimpl)."
            if lookalikes
            else ""
        )
        raise PluginValidationError(
            plugin, f"plugin {name!r} has no @hookimpl methods.{hint}"
        )
    for attr in lookalikes:
        warnings.warn(
            f"plugin {name!r}: method {attr!r} is named like the hook but not marked "
            f"@hookimpl, so it is never called (its other hook methods are marked). "
            f"Add @hookimpl, or rename it.",
            UnmarkedHookWarning,
            stacklevel=5,  # Loop(...) in the user's code
        )
    has_save = callable(getattr(plugin, "state_dict", None))
    has_load = callable(getattr(plugin, "load_state_dict", None))
    if has_save != has_load:
        present, missing = ("state_dict", "load_state_dict") if has_save else (
            "load_state_dict", "state_dict")
        raise PluginValidationError(
            plugin,
            f"plugin {name!r} has {present}() but no {missing}(): checkpoints keep a "
            "plugin's state only when it has both (state_dict() -> dict, "
            "load_state_dict(state)). Add the other one, or rename this one.",
        )


def _check_signature(plugin, name, attr, hook, method) -> None:
    """A hook implementation names the arguments it takes: pluggy passes
    nothing to ``*args`` / ``**kwargs`` (they would silently stay empty)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    for p in params:
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            star = "**" if p.kind is p.VAR_KEYWORD else "*"
            raise PluginValidationError(
                plugin,
                f"plugin {name!r}: method {attr!r} (hook {hook!r}) takes "
                f"{star}{p.name}, which would always be empty: a hook implementation "
                "receives only the arguments it names. Name the ones you need "
                f"from: {', '.join(_spec_args(hook))}",
            )


# ---------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------


def _noop(**kwargs):
    """A firstresult hook nobody implements: no result."""
    return None


def _noop_broadcast(**kwargs):
    """A broadcast hook nobody implements: no results (as pluggy returns)."""
    return []


class HookRelay:
    """``loop.hook``: one attribute per hook, called with keyword arguments.

    A hook that no plugin implements is a plain no-op function, so the
    per-step path pays nothing for it (pluggy's own call costs ~0.6 µs even
    with no implementation). A hook whose implementations are all plain (no
    wrappers), with no call monitoring on, is a generated function that calls
    them in pluggy's order with the arguments each one asks for, as pluggy's
    ``_multicall`` does, at ~0.05 µs per implementation instead of ~0.3-0.5.
    Anything else is pluggy's own caller. Replaced whenever the set of
    plugins changes; each hook's caller is made on first use.
    """

    def __init__(self, pm: pluggy.PluginManager):
        self._pm = pm

    def __getattr__(self, name):  # only for attributes not made yet
        if name.startswith("_") or name not in hook_names():
            raise AttributeError(f"{name!r} is not a hookloop hook")
        caller = getattr(self._pm.hook, name)
        impls = caller.get_hookimpls()
        if not impls:
            firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
            caller = _noop if firstresult else _noop_broadcast
        elif not (
            # monitoring (HOOKLOOP_TRACE, add_hookcall_monitoring) replaces _multicall
            getattr(self._pm, "_inner_hookexec", None) is not _multicall
            or any(i.wrapper or i.hookwrapper for i in impls)
            or varnames(getattr(hookspecs, name))[1]  # spec defaults: pluggy applies them
        ):
            firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
            caller = _direct_caller(name, impls, firstresult)
        setattr(self, name, caller)
        return caller


def _direct_caller(name, impls, firstresult):
    """``f(**kwargs)`` calling ``impls`` as pluggy does: last registered first
    (``impls`` is in pluggy's order), each with the arguments it names;
    firstresult hooks stop at the first non-None result, the others return
    the list of non-None results."""
    spec_args = _spec_args(name)
    namespace = {}
    # keyword-only, as pluggy's callers are; extra keywords ignored, as pluggy does
    params = ", ".join(["*", *spec_args, "**_extra"]) if spec_args else "**_extra"
    lines = [f"def {name}({params}):"]
    if not firstresult:
        lines.append("    results = []")
    for i, impl in enumerate(reversed(impls)):
        namespace[f"impl{i}"] = impl.function
        args = [*impl.argnames, *(f"{a}={a}" for a in impl.kwargnames if a in spec_args)]
        lines.append(f"    result = impl{i}({', '.join(args)})")
        lines.append("    if result is not None:")
        lines.append("        return result" if firstresult else "        results.append(result)")
    lines.append("    return None" if firstresult else "    return results")
    exec(compile("\n".join(lines), f"<hookloop hook {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


class PluginManager:
    """pluggy's manager plus validation, ordering, names and attribution."""

    def __init__(self):
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        #: name -> where it came from ("built-in", "code", or an entry point)
        self.sources: dict[str, str] = {}
        self.hook = HookRelay(self.pm)
        if os.environ.get(ENV_TRACE):
            self._enable_tracing()

    def register(self, plugin, name: str, source: str) -> None:
        if self.pm.is_registered(plugin):  # before validation: its warnings were given once
            raise PluginValidationError(
                plugin,
                f"plugin {name!r} is given twice (the same object): from "
                f"{self.sources.get(self.pm.get_name(plugin), '?')} and from {source}. "
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
        self._order_trylast()
        self.refresh()

    def register_all(self, given, *, strategy, defaults, builtins, block=()) -> None:
        """Register a loop's plugins so that calls go: ``given`` (in order),
        switched-on installed plugins, then the built-ins (``strategy``
        first, then its ``defaults``). pluggy calls the last registered
        first, hence the reversed registration.

        :param given: ``Loop(plugins=[...])``: objects, names of built-in or
            installed plugins, ``(name, {options})`` pairs.
        :param builtins: the built-in plugins by name (``"logger"`` ->
            class), for plugins given by name.
        :param block: names never to register (with ``HOOKLOOP_BLOCK_PLUGINS``).
        """
        blocked = blocked_names(block)
        if strategy.name in blocked:
            raise PluginValidationError(strategy, f"the strategy {strategy.name!r} cannot be blocked")
        installed = None
        user = []
        for i, item in enumerate(given):
            if isinstance(item, (str, tuple)):
                if installed is None:
                    installed = {i.name: i for i in discover()}
                plugin, source, explicit, base = resolve_named(item, installed, builtins)
            else:
                plugin, source, explicit = item, "code", explicit_name(item)
                base = plugin_name(item)
            user.append((plugin, explicit, base, f"{source}, plugins[{i}]"))
        user = name_instances(user)
        user_names = {name for _, name, _ in user}
        if installed is None and not os.environ.get(ENV_DISABLE_AUTOLOAD):
            installed = {i.name: i for i in discover()}
        auto = []
        for item in (installed or {}).values():
            if item.name in user_names or not autoload_considered(item.name, block):
                continue
            if item.error is not None:  # one broken distribution does not stop the others
                warn_broken(item)
            elif autoload_decision(item, block)[0]:
                auto.append((item.instantiate(), item.name, item.describe()))
        builtin = [(p, plugin_name(p), "built-in") for p in [strategy, *defaults]]
        builtin = [b for b in builtin if b[1] not in user_names or b[0] is strategy]
        for plugin, name, source in [*builtin, *reversed(auto), *reversed(user)]:
            if name in blocked:
                continue
            self.register(plugin, name, source)

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.sources.pop(name, None)
        self.refresh()

    def refresh(self) -> None:
        """Rebuild ``hook`` (the relay caches each hook's callers): call it
        after changing implementations or adding call monitoring by hand."""
        self.hook = HookRelay(self.pm)

    def add_hookcall_monitoring(self, before, after):
        """pluggy's ``add_hookcall_monitoring``, then :meth:`refresh`, so
        that the monitoring sees every call. Returns the undo function."""
        undo = self.pm.add_hookcall_monitoring(before, after)
        self.refresh()

        def undo_and_refresh():
            undo()
            self.refresh()

        return undo_and_refresh

    def _order_trylast(self) -> None:
        """pluggy calls plain and ``tryfirst`` implementations last-registered
        first, but ``trylast`` ones first-registered first. The loop registers
        in reverse of the wanted call order, so put every ``trylast`` block in
        registration order (pluggy calls a list from its end): then
        ``trylast`` implementations too run in list order, user plugins'
        before the built-in defaults'."""
        order = {name: i for i, name in enumerate(self.sources)}
        for name in hook_names():
            impls = getattr(self.pm.hook, name)._hookimpls
            for wrappers in (False, True):
                positions = [i for i, impl in enumerate(impls)
                             if impl.trylast and bool(impl.wrapper or impl.hookwrapper) == wrappers]
                ranked = sorted((impls[i] for i in positions),
                                key=lambda impl: order.get(impl.plugin_name, -1))
                for i, impl in zip(positions, ranked):
                    impls[i] = impl

    def names(self) -> list[str]:
        return [name for name, plugin in self.pm.list_name_plugin() if plugin is not None]

    def get(self, name: str):
        return self.pm.get_plugin(name)

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
        by_code: dict = {}
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

    def _enable_tracing(self):
        def before(hook_name, hook_impls, kwargs):
            names = ", ".join(impl.plugin_name for impl in hook_impls)
            print(f"[hookloop] {hook_name} -> {names}", file=sys.stderr)

        def after(outcome, hook_name, hook_impls, kwargs):
            pass

        self.add_hookcall_monitoring(before, after)


# ---------------------------------------------------------------------------
# naming: which name each plugin of a loop is registered under
# ---------------------------------------------------------------------------


def explicit_name(plugin) -> str | None:
    """The name a plugin object was given itself (an instance attribute
    ``name``, a module's name), or None: then it is named after its class,
    and several instances are told apart by number."""
    if inspect.ismodule(plugin):
        return plugin.__name__
    name = vars(plugin).get("name") if hasattr(plugin, "__dict__") else None
    return name if isinstance(name, str) and name else None


def name_instances(entries):
    """``(plugin, explicit name or None, base name, source)`` ->
    ``(plugin, name, source)``.

    Explicit names are kept (two alike are an error at registration, naming
    both). A plugin without one takes its class's name (``Logger``:
    ``"logger"``); the next instance of that name becomes ``"logger-2"``,
    then ``"logger-3"``: deterministic, so the same script gives the same
    names and a checkpoint's plugin states find their plugins again."""
    taken = {explicit for _, explicit, _, _ in entries if explicit is not None}
    out = []
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


def resolve_named(item, installed, builtins):
    """A plugin given by name (a built-in of ``builtins``, name -> class, or
    an installed one): ``(plugin, source, explicit name or None, base name)``.
    ``("logger", {"name": "fast", "every": 2})``: the option ``name`` names
    the instance (and is passed on only to a class that takes ``name``)."""
    name, options = (item, None) if isinstance(item, str) else item
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


def warn_broken(item: Installed) -> None:
    warnings.warn(
        f"hookloop: skipping installed plugin {item.name!r}: {item.describe()} "
        f"failed to import: {type(item.error).__name__}: {item.error}",
        RuntimeWarning,
        stacklevel=3,
    )
