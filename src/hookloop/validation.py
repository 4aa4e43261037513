"""What a plugin may look like: the hooks there are, the arguments each one
takes, and the checks a plugin passes before it is registered.

:func:`validate` refuses, naming the plugin, the method and the valid
choices, what pluggy would accept silently or report only at call time: a
misnamed hook (with a "did you mean", also for Lightning's and the Hugging
Face Trainer's names, :data:`FOREIGN_HOOKS`), an argument the hook does not
have, ``*args`` / ``**kwargs``, a wrapper without ``yield``, a class instead
of an instance, half a ``state_dict`` / ``load_state_dict`` pair. A method
named like a hook but left unmarked warns (:class:`UnmarkedHookWarning`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from collections.abc import Iterable
from typing import Any

from . import hookspecs
from ._pluggy import varnames
from .errors import PluginValidationError
from .markers import PROJECT_NAME


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


def _spec_args(name: str) -> tuple[str, ...]:
    return varnames(getattr(hookspecs, name))[0]


def implemented_hooks(plugin: object) -> list[str]:
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


def suggest_hook(hook: str, valid: Iterable[str] | None = None) -> str:
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


def validate(plugin: object, name: str) -> None:
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


def _check_signature(plugin: object, name: str, attr: str, hook: str, method: Any) -> None:
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
