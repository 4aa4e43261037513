"""``loop.hook``: each hook as a function of keyword arguments, at the least
cost that calls the implementations exactly as pluggy would.

A hook nobody implements is a no-op; one whose implementations are all plain
is a generated function calling them in pluggy's order (while
:mod:`hookloop._pluggy` finds pluggy's call path to be the verified one);
anything else is pluggy's own caller.
"""

from __future__ import annotations

import pluggy

from . import hookspecs
from ._pluggy import calls_directly, varnames
from .validation import _spec_args, hook_names


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
    Anything else is pluggy's own caller; so is every implemented hook when
    :mod:`hookloop._pluggy` does not find the verified ``_multicall`` (another
    pluggy, or ``HOOKLOOP_PLUGGY_PRIVATES=0``). Replaced whenever the set of
    plugins changes; each hook's caller is made on first use.
    """

    def __init__(self, pm: pluggy.PluginManager):
        self._pm = pm
        self._unimplemented: dict = {}

    def unimplemented(self, names: tuple) -> bool:
        """Whether no plugin implements any of the hooks ``names``: the per-step
        path then leaves their calls out (pluggy would call nothing, and no
        call monitor sees a call of an unimplemented hook here either), which
        saves ~0.1-0.2 µs a call. Known for as long as this relay lives: a
        change of plugins makes a new one."""
        known = self._unimplemented.get(names)
        if known is None:
            known = self._unimplemented[names] = all(
                getattr(self, name) in (_noop, _noop_broadcast) for name in names)
        return known

    def __getattr__(self, name):  # only for attributes not made yet
        if name.startswith("_") or name not in hook_names():
            raise AttributeError(f"{name!r} is not a hookloop hook")
        caller = getattr(self._pm.hook, name)
        impls = caller.get_hookimpls()
        if not impls:
            firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
            caller = _noop if firstresult else _noop_broadcast
        elif (
            # pluggy's verified _multicall, not monitoring (HOOKLOOP_TRACE,
            # add_hookcall_monitoring), runs the hooks: see hookloop._pluggy
            calls_directly(self._pm)
            and not any(i.wrapper or i.hookwrapper for i in impls)
            and not varnames(getattr(hookspecs, name))[1]  # spec defaults: pluggy applies them
        ):
            firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
            caller = _direct_caller(name, impls, firstresult)
        setattr(self, name, caller)
        return caller

    def named(self, name):
        """A caller of the broadcast hook ``name`` that returns ``[(plugin
        name, result), ...]`` (non-None results, in call order), to say which
        plugin returned what; None when pluggy's own caller runs the hook
        (wrappers, monitoring): then only its results are known."""
        cache = self.__dict__.setdefault("_named", {})
        if name not in cache:
            caller = getattr(self._pm.hook, name)
            impls = caller.get_hookimpls()
            plain = (calls_directly(self._pm) and not any(i.wrapper or i.hookwrapper for i in impls)
                     and not varnames(getattr(hookspecs, name))[1])
            cache[name] = (_direct_caller(name, impls, False, named=True) if plain and impls
                           else (lambda **kwargs: []) if not impls else None)
        return cache[name]


def _direct_caller(name, impls, firstresult, named=False):
    """``f(**kwargs)`` calling ``impls`` as pluggy does: last registered first
    (``impls`` is in pluggy's order), each with the arguments it names;
    firstresult hooks stop at the first non-None result, the others return
    the list of non-None results (``named``: of ``(plugin name, result)``)."""
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
        found = f"({impl.plugin_name!r}, result)" if named else "result"
        lines.append("        return result" if firstresult else f"        results.append({found})")
    lines.append("    return None" if firstresult else "    return results")
    exec(compile("\n".join(lines), f"<hookloop hook {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]
