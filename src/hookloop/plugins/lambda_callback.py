"""A plugin made of functions, keyed by hook name, as Lightning's ``LambdaCallback``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..errors import PluginValidationError
from ..manager import _spec_args, hook_names
from ..markers import hookimpl

#: Lightning ``Callback`` hook names -> the hookloop hook that runs at that point
LIGHTNING_HOOKS = {
    "setup": "on_fit_start",
    "on_train_start": "on_fit_start",
    "on_train_end": "on_fit_end",
    "teardown": "on_fit_end",
    "on_train_epoch_start": "on_epoch_start",
    "on_train_batch_start": "before_step",
    "on_train_batch_end": "after_step",
    "on_before_backward": "before_backward",
    "on_after_backward": "after_backward",
    "on_before_optimizer_step": "before_optimizer_step",
    "on_before_zero_grad": "before_zero_grad",
    "on_validation_start": "on_eval_start",
    "on_validation_epoch_start": "on_eval_start",
    "on_validation_batch_end": "after_eval_step",
    "on_validation_epoch_end": "on_eval_end",
    "on_validation_end": "on_eval_end",
}

#: Lightning names without a hookloop hook, and what to do instead
UNSUPPORTED = {
    "on_save_checkpoint": "plugin state goes in checkpoints through state_dict() / load_state_dict(state) "
                          "methods: write a small class",
    "on_load_checkpoint": "plugin state goes in checkpoints through state_dict() / load_state_dict(state) "
                          "methods: write a small class",
    "on_sanity_check_start": "the sanity check is an evaluation: on_eval_start with "
                             "loop.state.stage == 'sanity'",
    "on_sanity_check_end": "the sanity check is an evaluation: on_eval_end with "
                           "loop.state.stage == 'sanity'",
    "on_validation_batch_start": "use after_eval_step, or a wrapper on eval_step",
    "on_predict_start": "loop.predict(data) calls only eval_step (loop.state.stage == 'predict')",
    "on_predict_end": "loop.predict(data) returns every output: act on its result",
    "on_predict_batch_start": "wrap eval_step and check loop.state.stage == 'predict'",
    "on_predict_batch_end": "wrap eval_step and check loop.state.stage == 'predict'",
    "on_predict_epoch_start": "loop.predict(data) calls only eval_step (loop.state.stage == 'predict')",
    "on_predict_epoch_end": "loop.predict(data) returns every output: act on its result",
    "on_test_start": "use loop.evaluate(test_data): on_eval_start",
    "on_test_end": "use loop.evaluate(test_data): on_eval_end",
    "on_test_epoch_start": "use loop.evaluate(test_data): on_eval_start",
    "on_test_epoch_end": "use loop.evaluate(test_data): on_eval_end",
    "on_test_batch_start": "use loop.evaluate(test_data): after_eval_step",
    "on_test_batch_end": "use loop.evaluate(test_data): after_eval_step",
}

#: hooks whose result the loop uses: only one function may answer them
_ANSWERING = ("training_step", "compute_loss", "eval_step", "after_eval_step")


class LambdaCallback:
    """A plugin built from functions, one per hook, by keyword::

        LambdaCallback(after_step=lambda loop, loss: ...,
                       on_epoch_end=lambda epoch, metrics: print(epoch, metrics))

    Each function takes, by name, any of the arguments of its hook (as a
    ``@hookimpl`` method would, without ``self``); a ``**kwargs`` function
    receives all of them. Lightning's callback names are accepted too and
    mapped to the hookloop hook that runs at that point
    (:data:`LIGHTNING_HOOKS`: ``on_train_batch_end`` is ``after_step``,
    ``on_validation_epoch_end`` is ``on_eval_end`` ...), but the function
    still receives hookloop's arguments (``loop``, ``batch`` ...), not
    ``trainer, pl_module``. Names both libraries use keep hookloop's
    meaning: ``on_train_epoch_end`` runs before the epoch's evaluation
    (Lightning's after it: give ``on_epoch_end`` for that). Several names of
    one hook run in the order given. A name that is no hook, a Lightning name without a hookloop
    counterpart, or an argument the hook does not have is an error when the
    plugin is made, listing the valid choices.

    :param name: the plugin's name (default: ``lambda``, ``lambda-2`` ...).
    :param changes_training: what ``hookloop plugins`` shows (None: not
        declared); say False for an observer.
    """

    name = "lambda"

    def __init__(self, *, name: str | None = None, changes_training: bool | None = None,
                 **hooks: Callable[..., Any]) -> None:
        if name is not None:
            self.name = name
        if changes_training is not None:
            self.changes_training = changes_training
        label = name or "LambdaCallback"
        valid = hook_names()
        grouped: dict[str, list[tuple[str, Callable[..., Any]]]] = {}
        for key, function in hooks.items():
            hook = key if key in valid else LIGHTNING_HOOKS.get(key)
            if hook is None:
                why = UNSUPPORTED.get(key)
                raise PluginValidationError(self, (
                    f"{label}: {key!r} is Lightning's name of a point hookloop has no hook for ({why})"
                    if why else f"{label}: {key!r} is not a hook. hookloop hooks: {', '.join(valid)}; "
                    f"Lightning names accepted: {', '.join(LIGHTNING_HOOKS)}"))
            if not callable(function):
                raise PluginValidationError(self, f"{label}: {key}= must be a function, got "
                                                  f"{type(function).__name__}")
            grouped.setdefault(hook, []).append((key, function))
        if not grouped:
            raise PluginValidationError(self, f"{label}: give at least one function, e.g. "
                                              "LambdaCallback(after_step=lambda loop, loss: ...)")
        for hook, functions in grouped.items():
            if len(functions) > 1 and hook in _ANSWERING:
                keys = ", ".join(k for k, _ in functions)
                raise PluginValidationError(self, f"{label}: {keys} are all hook {hook!r}, whose result "
                                                  "the loop uses: give one function")
            setattr(self, hook, _implementation(label, hook, functions))

    def __repr__(self) -> str:
        hooks = [h for h in hook_names() if h in vars(self)]
        return f"LambdaCallback({', '.join(hooks)})"


def _implementation(label: str, hook: str,
                    functions: list[tuple[str, Callable[..., Any]]]) -> Callable[..., Any]:
    """A ``@hookimpl`` function for ``hook`` asking for the arguments the
    functions name, and calling each with its own."""
    spec = _spec_args(hook)
    calls: list[tuple[Callable[..., Any], list[str]]] = []
    for key, function in functions:
        try:
            params = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            raise PluginValidationError(function, f"{label}: cannot read the arguments of {key}=") from None
        names: list[str] = []
        for p in params:
            if p.kind is p.VAR_KEYWORD:
                names = list(spec)
                break
            if p.kind is p.VAR_POSITIONAL:
                raise PluginValidationError(function, (
                    f"{label}: {key}= takes *{p.name}; a hook function takes its arguments by name, "
                    f"from: {', '.join(spec)}"))
            if p.name not in spec:
                if p.default is not p.empty:
                    continue
                raise PluginValidationError(function, (
                    f"{label}: {key}= (hook {hook!r}) asks for {p.name!r}, which the hook does not "
                    f"have. Valid arguments: {', '.join(spec)}"))
            names.append(p.name)
        calls.append((function, names))
    wanted = [a for a in spec if any(a in names for _, names in calls)]
    namespace: dict[str, Any] = {"calls": calls}
    lines = [f"def {hook}({', '.join(wanted)}):"]
    for i, (_, names) in enumerate(calls):
        lines.append(f"    result = calls[{i}][0]({', '.join(f'{a}={a}' for a in names)})")
    lines.append("    return result")
    exec(compile("\n".join(lines), f"<LambdaCallback {hook}>", "exec"), namespace)  # noqa: S102
    implementation: Callable[..., Any] = namespace[hook]
    return hookimpl(implementation)
