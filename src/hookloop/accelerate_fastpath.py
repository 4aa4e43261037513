"""Accelerate's per-step calls, minus the work Accelerate repeats on every call.

In accelerate 1.15 every ``AcceleratedOptimizer.step()`` asks twice whether the
``lomo_optim`` package is installed (``importlib.util.find_spec`` walks
``sys.path``: ~27 µs each time), every ``zero_grad()`` builds an
``inspect.signature`` of the wrapped optimizer's ``zero_grad`` (~7 µs), and
every ``Accelerator.backward(loss)`` divides the loss by
``gradient_accumulation_steps`` even when that is 1 (a tensor op and one more
autograd node, ~6 µs). On a step of a few hundred µs that is a quarter of the
time; none of it changes a number.

:class:`FastPath` makes the same calls with those answers worked out once:

- ``step(optimizer)``: ``optimizer.optimizer.step(None)`` when
  ``accelerator.sync_gradients``, else nothing — what
  ``AcceleratedOptimizer.step`` does without a gradient scaler, off XLA, for a
  non-LOMO optimizer;
- ``zero_grad(optimizer)``: ``optimizer.optimizer.zero_grad(set_to_none=True)``
  (or ``zero_grad()`` if it takes no such argument) when synchronising;
- ``backward(loss)``: ``loss.backward()`` when Accelerate would do exactly that
  (no DeepSpeed or Megatron-LM, no gradient scaler, no accumulation: dividing
  by 1 is exact, so the gradients are bitwise the same).

Anything else is handed to Accelerate unchanged: a gradient scaler (fp16),
XLA, DeepSpeed/Megatron wrappers (subclasses of ``AcceleratedOptimizer``), a
LOMO optimizer, an optimizer or accelerator whose ``step`` / ``zero_grad`` /
``backward`` was replaced, and gradient accumulation for ``backward``.

It is used only where the installed Accelerate's methods are the ones this
module was checked against: ``VERIFIED`` holds a fingerprint of the source of
``AcceleratedOptimizer.step``, ``AcceleratedOptimizer.zero_grad`` and
``Accelerator.backward`` (comments, docstrings and layout ignored). Another
Accelerate with other code there gets Accelerate's own calls, and the test
``tests/test_accelerate_fastpath.py`` says so. ``HOOKLOOP_ACCELERATE_FASTPATH=0``
switches the fast path off.

Decisions are taken per ``fit`` (the loop builds a new :class:`FastPath` after
``on_fit_start``), so a plugin that wraps ``optimizer.step`` must do it before
then: a wrapper installed in the middle of a fit is not seen.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import textwrap

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

ENV = "HOOKLOOP_ACCELERATE_FASTPATH"

#: fingerprints of the Accelerate code the fast path stands in for, each
#: checked line by line (accelerate 1.15.0); add one after checking a new
#: version's code and running tests/test_accelerate_fastpath.py
VERIFIED = {
    "AcceleratedOptimizer.step": {"df01b103c444a7dc"},
    "AcceleratedOptimizer.zero_grad": {"a1be53cba39b06a7"},
    "Accelerator.backward": {"79c32c236a8bcd44"},
}


@functools.lru_cache(maxsize=None)
def fingerprint(func) -> str:
    """A hash of a function's code with comments, docstrings and layout
    removed: it changes when what the function does may have changed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]


def accelerate_verified() -> bool:
    """Whether the installed Accelerate's code (as it is now: a method
    replaced at run time counts as changed) is the code ``VERIFIED`` names."""
    installed = {
        "AcceleratedOptimizer.step": AcceleratedOptimizer.step,
        "AcceleratedOptimizer.zero_grad": AcceleratedOptimizer.zero_grad,
        "Accelerator.backward": Accelerator.backward,
    }
    try:
        return all(fingerprint(f) in VERIFIED[name] for name, f in installed.items())
    except (OSError, TypeError, SyntaxError):  # no source to read: do not guess
        return False


def enabled() -> bool:
    """The fast path is on: not switched off, and Accelerate is a verified one."""
    switch = os.environ.get(ENV, "1").strip().lower()
    return switch not in ("0", "false", "no", "off") and accelerate_verified()


class FastPath:
    """``backward``, ``step`` and ``zero_grad`` as a strategy calls them.

    :param accelerator: the loop's ``Accelerator``; its configuration is read
        once, here.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self._gradient_state = accelerator.gradient_state
        self.enabled = enabled()
        #: ``backward(loss)`` is ``loss.backward()``
        self.plain_backward = (
            self.enabled
            and type(accelerator).backward is Accelerator.backward
            and "backward" not in vars(accelerator)
            and accelerator.distributed_type
            not in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
            and accelerator.scaler is None
            and accelerator.gradient_accumulation_steps == 1
        )
        # optimizer -> (wrapped optimizer, zero_grad takes set_to_none) or None
        self._plans: dict = {}

    def backward(self, loss):
        """``accelerator.backward(loss)``."""
        if self.plain_backward:
            loss.backward()
        else:
            self.accelerator.backward(loss)

    def step(self, optimizer):
        """``optimizer.step()``."""
        plan = self._plans.get(optimizer, False)
        if plan is False:
            plan = self._plan(optimizer)
        if plan is None:
            optimizer.step()
        elif self._gradient_state.sync_gradients:
            plan[0].step(None)  # Accelerate passes closure=None positionally

    def zero_grad(self, optimizer):
        """``optimizer.zero_grad()``."""
        plan = self._plans.get(optimizer, False)
        if plan is False:
            plan = self._plan(optimizer)
        if plan is None:
            optimizer.zero_grad()
        elif self._gradient_state.sync_gradients:
            if plan[1]:
                plan[0].zero_grad(set_to_none=True)
            else:
                plan[0].zero_grad()

    def is_fast(self, optimizer) -> bool:
        """Whether ``step`` / ``zero_grad`` of this optimizer skip Accelerate."""
        plan = self._plans.get(optimizer, False)
        return (self._plan(optimizer) if plan is False else plan) is not None

    def forget(self):
        """Drop the references to optimizers (``Loop.close``)."""
        self._plans.clear()

    def _plan(self, optimizer):
        plan = None
        if self.enabled and _plain_accelerated(optimizer):
            inner = optimizer.optimizer
            takes = "set_to_none" in inspect.signature(inner.zero_grad).parameters
            plan = (inner, takes)
        self._plans[optimizer] = plan
        return plan


def _plain_accelerated(optimizer) -> bool:
    """An ``AcceleratedOptimizer`` whose ``step`` would take the plain branch:
    no scaler, not XLA, not LOMO, nothing replaced on the instance."""
    if type(optimizer) is not AcceleratedOptimizer:
        return False
    if "step" in vars(optimizer) or "zero_grad" in vars(optimizer):
        return False
    if optimizer.scaler is not None:
        return False
    if optimizer.accelerator_state.distributed_type == DistributedType.XLA:
        return False
    from accelerate.utils import is_lomo_available

    if is_lomo_available():
        from lomo_optim import AdaLomo, Lomo

        if isinstance(optimizer.optimizer, (Lomo, AdaLomo)):
            return False
    return True
