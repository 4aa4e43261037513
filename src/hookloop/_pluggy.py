"""pluggy's private names, each behind a check, with a fallback to public API.

This is the only module of hookloop that touches pluggy's privates. hookloop
reads two and writes to none; neither is needed to be correct, each one is there
to be fast or exact:

``pluggy._callers._multicall`` (with ``HookCaller.__call__`` and
``PluginManager._hookexec``, the path from a hook call to it)
    :class:`hookloop.relay.HookRelay` calls a hook whose implementations are
    all plain (no wrappers) through a generated function that calls them as
    these do, in ~0.05 µs per implementation instead of ~0.3-0.5 µs. It does
    so only when the three are the code ``VERIFIED`` names, and only for a
    manager whose executor *is* this ``_multicall`` (call monitoring, e.g.
    ``HOOKLOOP_TRACE``, replaces it). Fallback: pluggy's own hook callers for
    every hook. Same calls, same order, same results; each call of an
    implemented hook costs what pluggy costs (hooks nobody implements stay
    free, which is public API: ``get_hookimpls()``).
``pluggy._hooks.varnames``
    the argument names of a hook specification or implementation, as pluggy
    reads them (``(positional, with defaults)``): hookloop checks a plugin's
    arguments against the hook's with the very function pluggy uses to decide
    what to pass. Used whatever its code (pluggy's answer is the right one by
    definition), so only its presence is checked. Fallback:
    :func:`inspect_varnames`, the same reading of a function's code with
    ``inspect`` (functions, bound and unbound methods, classes, callable
    objects, ``functools.wraps`` wrappers); ``tests/manager/test_pluggy_privates.py``
    checks the two agree. It could differ only where a later pluggy changes
    how it reads arguments.

The order in which implementations run is pluggy's public behaviour alone
(:func:`hookloop.manager.trylast_in_registration_order`).

Nothing is touched at import time: ``import hookloop`` works with any pluggy
that has the public API (``pluggy>=1.7``). Another pluggy whose code differs
where a fingerprint is checked gets the fallback, and the test
``tests/manager/test_pluggy_privates.py`` says so (after checking the new
code line by line, add its fingerprint to ``VERIFIED``).
``HOOKLOOP_PLUGGY_PRIVATES=0`` switches both off (the fallbacks above): the
same calls in the same order, the same results.
"""

from __future__ import annotations

import importlib
import inspect
import os

import pluggy

from ._fingerprint import fingerprint

ENV = "HOOKLOOP_PLUGGY_PRIVATES"

#: fingerprints of the pluggy code hookloop relies on, each checked line by
#: line (pluggy 1.7.0)
VERIFIED = {
    "_multicall": {"32f6076609858029"},
    "HookCaller.__call__": {"64d9855993e5f1c5"},
    "PluginManager._hookexec": {"ea3bbf2e910b135a"},
}


def enabled() -> bool:
    """hookloop may use pluggy's privates at all (``HOOKLOOP_PLUGGY_PRIVATES``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _private(module: str, name: str):
    """``module.name`` if pluggy still has it, else ``None`` (also when switched off)."""
    if not enabled():
        return None
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _verified(key: str, func) -> bool:
    try:
        return func is not None and fingerprint(func) in VERIFIED[key]
    except (OSError, TypeError, SyntaxError):  # no source to read: do not guess
        return False


def multicall():
    """pluggy's ``_multicall`` when present and, with the path a hook call
    takes to it, the verified code; else ``None``."""
    func = _private("pluggy._callers", "_multicall")
    if not (_verified("_multicall", func)
            and _verified("HookCaller.__call__", getattr(pluggy.HookCaller, "__call__", None))
            and _verified("PluginManager._hookexec",
                          getattr(pluggy.PluginManager, "_hookexec", None))):
        return None
    return func


def calls_directly(pm: pluggy.PluginManager) -> bool:
    """Whether a relay may call ``pm``'s plain implementations itself: a
    verified ``_multicall`` is what ``pm`` runs hooks with (no monitoring)."""
    func = multicall()
    return func is not None and getattr(pm, "_inner_hookexec", None) is func


def find_varnames():
    """pluggy's ``varnames`` if it has one, else :func:`inspect_varnames`."""
    func = _private("pluggy._hooks", "varnames")
    return func if callable(func) else inspect_varnames


def varnames(func) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(positional argument names, those with defaults)`` of a callable, as
    pluggy reads them: the arguments it passes a hook implementation."""
    return find_varnames()(func)


_IMPLICIT_NAMES = ("self", "cls")


def inspect_varnames(func) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """pluggy 1.7's ``varnames`` with public Python only: a class stands for
    its ``__init__``, a callable object for its ``__call__``; wrappers are
    unwrapped; a bound method loses its first argument, and so does a
    function defined in a class whose first argument is ``self`` or ``cls``;
    keyword-only and ``*args`` / ``**kwargs`` are not listed."""
    is_bound = False
    if inspect.isclass(func):
        try:
            func = func.__init__
        except AttributeError:
            return (), ()
        is_bound = True
    elif not inspect.isroutine(func):
        try:
            func = getattr(func, "__call__", func)  # noqa: B004 - the attribute itself
        except Exception:  # noqa: BLE001 - as pluggy: no arguments
            return (), ()
    if inspect.ismethod(func):
        is_bound = True
    func = inspect.unwrap(func)
    if inspect.ismethod(func):
        is_bound = True
        func = func.__func__
    try:
        code, defaults, qualname = func.__code__, func.__defaults__, func.__qualname__
    except AttributeError:  # a builtin: nothing to read
        return (), ()
    args = code.co_varnames[: code.co_argcount]
    kwargs: tuple[str, ...] = ()
    if defaults:
        args, kwargs = args[: -len(defaults)], args[-len(defaults):]
    in_class = "." in qualname.rsplit("<locals>.", maxsplit=1)[-1]
    if args and (is_bound or (in_class and args[0] in _IMPLICIT_NAMES)):
        args = args[1:]
    return tuple(args), tuple(kwargs)


def status() -> dict:
    """Which privates are in use now (for tests and bug reports)."""
    probe = pluggy.PluginManager("hookloop-probe")
    probe.add_hookspecs(_ProbeSpec)
    return {
        "direct_calls": calls_directly(probe),
        "varnames": "pluggy" if find_varnames() is not inspect_varnames else "inspect",
    }


class _ProbeSpec:
    @pluggy.HookspecMarker("hookloop-probe")
    def probe(self):
        """A hook to look at a ``HookCaller`` with."""
