"""Where the time of a training step goes, per plugin and per hook.

An observer: installed, it profiles every ``Loop.fit`` and prints at the end::

    hookloop profiler: 16 steps, 1581.2 µs/step (25.3 ms in steps, fit 40.1 ms)
    plugin      hook             calls   µs/call  self µs/call  % of step
    supervised  training_step       16    1402.1        1300.5      82.2%
    loss        compute_loss        16      45.2          45.2       2.9%
    ...
    (the loop, Accelerate, pluggy and the profiler between hook implementations)  12.1%

``µs/call`` includes the hooks an implementation calls itself (a strategy's
``training_step`` calls ``compute_loss``...); ``self µs/call`` does not.
``% of step`` is the self time spent inside training steps (from the start of
``before_step`` to the end of ``after_step``) over the total step time, so the
shares add up to 100% with the last line. Every hook implemented by a
registered plugin (the profiler's own excepted) has a row, also when it was
never called.

It measures by wrapping each hook implementation's function for the
duration of the fit (a few hundred nanoseconds per call) and puts them back
at the end or when anything raises. It reads no tensor, so it changes no
number and never synchronises a GPU.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from hookloop import hookimpl
from hookloop.manager import hook_names

__version__ = "0.1.0"

__all__ = ["Profiler"]

_clock = time.perf_counter_ns


@dataclass
class _Stat:
    calls: int = 0
    total_ns: int = 0  # inclusive of nested hook calls
    self_ns: int = 0  # exclusive
    step_self_ns: int = 0  # exclusive, inside training steps


class Profiler:
    """Time each hook implementation of each plugin during ``fit``.

    :param print_table: print the table at the end of each fit (main process
        only, through ``loop.print``).
    :param file: also write the rows as JSON to this path (main process only).

    After a fit, :attr:`rows` holds one dict per (plugin, hook): ``plugin``,
    ``hook``, ``calls``, ``us_per_call``, ``self_us_per_call``, ``total_us``,
    ``step_share`` (a fraction of the step time); :attr:`steps` and
    :attr:`step_us` describe the steps. Each process measures itself.
    """

    name = "profiler"
    #: only observes: acts as soon as it is installed (see hookloop's activation rule)
    autoload = True
    changes_training = False  # measures only

    def __init__(self, print_table: bool = True, file=None):
        self.print_table = print_table
        self.file = file
        self.rows: list[dict] = []
        self.steps = 0
        self.step_us = 0.0
        self.fit_us = 0.0
        self._stats: dict[tuple[str, str], _Stat] = {}
        self._order: list[tuple[str, str]] = []
        self._wrapped: list = []  # (HookImpl, original function)
        self._stack: list[int] = []  # nested time of the calls in progress
        self._in_step = False
        self._step_start = 0
        self._step_ns = 0
        self._fit_start = 0

    # -- hooks -------------------------------------------------------------------

    @hookimpl(wrapper=True, tryfirst=True)
    def on_fit_start(self, loop):
        # a wrapper's first half runs before every implementation of the hook:
        # on_fit_start itself is measured
        self._install(loop)
        self._fit_start = _clock()
        return (yield)

    @hookimpl(wrapper=True, tryfirst=True)
    def before_step(self, loop):
        self._step_start = _clock()
        self._in_step = True
        result = yield
        if loop.state.skip_batch:  # a skipped batch is not a step
            self._in_step = False
        return result

    @hookimpl(wrapper=True, tryfirst=True)
    def after_step(self):
        result = yield
        self._step_ns += _clock() - self._step_start
        self.steps += 1
        self._in_step = False
        return result

    @hookimpl(wrapper=True, tryfirst=True)
    def on_fit_end(self, loop):
        result = yield  # every other on_fit_end has run, measured
        self.fit_us = (_clock() - self._fit_start) / 1000
        self._uninstall(loop)
        self._report(loop)
        return result

    @hookimpl(tryfirst=True)
    def on_exception(self, loop):
        # first: the loop names the plugin that raised from the functions it
        # finds in the traceback, so the real ones must be back
        self._uninstall(loop)

    # -- the table ---------------------------------------------------------------

    def table(self) -> str:
        """The last fit's measurements as text."""
        head = (f"hookloop profiler: {self.steps} steps, "
                f"{self.step_us / max(self.steps, 1):.1f} µs/step "
                f"({self.step_us / 1000:.1f} ms in steps, fit {self.fit_us / 1000:.1f} ms)")
        cols = ("plugin", "hook", "calls", "µs/call", "self µs/call", "% of step")
        body = []
        for r in self.rows:
            called = r["calls"] > 0
            body.append((
                r["plugin"], r["hook"], str(r["calls"]),
                f"{r['us_per_call']:.1f}" if called else "-",
                f"{r['self_us_per_call']:.1f}" if called else "-",
                f"{100 * r['step_share']:.1f}%" if r["step_share"] else "-",
            ))
        widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
        lines = [head]
        for row in (cols, *body):
            cells = [row[i].ljust(widths[i]) if i < 2 else row[i].rjust(widths[i]) for i in range(len(cols))]
            lines.append("  ".join(cells))
        lines.append(f"(the loop, Accelerate, pluggy and the profiler between hook implementations) "
                     f"{100 * self.other_share:.1f}%")
        return "\n".join(lines)

    @property
    def other_share(self) -> float:
        """The share of step time spent outside every hook implementation."""
        if not self._step_ns:
            return 0.0
        inside = sum(s.step_self_ns for s in self._stats.values())
        return max(0.0, 1 - inside / self._step_ns)

    # -- internals -----------------------------------------------------------------

    def _install(self, loop):
        self._uninstall(loop)
        self._stats, self._order, self._stack = {}, [], []
        self._step_ns, self.steps, self._in_step = 0, 0, False
        pm = loop.plugins.pm
        for hook in hook_names():
            # pluggy keeps implementations last-called-first
            for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
                if impl.plugin is self:
                    continue
                key = (impl.plugin_name, hook)
                stat = self._stats[key] = _Stat()
                self._order.append(key)
                original = impl.function
                wrap = self._timed_generator if (impl.wrapper or impl.hookwrapper) else self._timed
                impl.function = wrap(original, stat)
                self._wrapped.append((impl, original))
        _refresh(loop)

    def _uninstall(self, loop):
        if not self._wrapped:
            return
        for impl, original in self._wrapped:
            impl.function = original
        self._wrapped = []
        _refresh(loop)

    def _timed(self, function, stat):
        stack = self._stack

        def timed(*args, **kwargs):
            stack.append(0)
            start = _clock()
            try:
                return function(*args, **kwargs)
            finally:
                self._account(stat, _clock() - start, stack.pop())
                stat.calls += 1

        return timed

    def _timed_generator(self, function, stat):
        """A wrapper implementation is a generator: time each of its segments
        (before its ``yield``, after it) and pass values and exceptions
        through as pluggy sends them."""
        stack = self._stack

        def segment(step, value):
            stack.append(0)
            start = _clock()
            try:
                return step(value)
            finally:
                self._account(stat, _clock() - start, stack.pop())

        def timed(*args, **kwargs):
            stat.calls += 1
            gen = function(*args, **kwargs)
            try:
                value = segment(gen.send, None)
                while True:
                    try:
                        sent = yield value
                    except GeneratorExit:
                        gen.close()
                        raise
                    except BaseException as exc:  # noqa: BLE001 - passed on to the wrapper
                        value = segment(gen.throw, exc)
                    else:
                        value = segment(gen.send, sent)
            except StopIteration as stop:
                return stop.value

        return timed

    def _account(self, stat, elapsed, nested):
        own = elapsed - nested
        stat.total_ns += elapsed
        stat.self_ns += own
        if self._in_step:
            stat.step_self_ns += own
        if self._stack:
            self._stack[-1] += elapsed

    def _report(self, loop):
        self.step_us = self._step_ns / 1000
        self.rows = []
        for plugin, hook in self._order:
            s = self._stats[(plugin, hook)]
            self.rows.append({
                "plugin": plugin,
                "hook": hook,
                "calls": s.calls,
                "total_us": s.total_ns / 1000,
                "us_per_call": s.total_ns / 1000 / s.calls if s.calls else None,
                "self_us_per_call": s.self_ns / 1000 / s.calls if s.calls else None,
                "step_share": s.step_self_ns / self._step_ns if self._step_ns else 0.0,
            })
        if not loop.accelerator.is_main_process:
            return
        if self.print_table:
            loop.print(self.table())
        if self.file is not None:
            with open(self.file, "w") as f:
                json.dump({"steps": self.steps, "step_us": self.step_us, "fit_us": self.fit_us,
                           "other_share": self.other_share, "rows": self.rows}, f, indent=2)


def _refresh(loop):
    """Make ``loop.hook`` call the current functions: hookloop's hook relay
    may bind each implementation's function when a hook is first called, so
    it is rebuilt after the functions are swapped (``Loop.fit`` takes its
    relay after ``on_fit_start``)."""
    plugins = loop.plugins
    refresh = getattr(plugins, "refresh", None)
    if refresh is not None:
        refresh()
    else:
        plugins.hook = type(plugins.hook)(plugins.pm)
