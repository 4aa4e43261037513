"""hookloop._pluggy: pluggy's private names are used only where they are the
verified ones, never written to, and without them hookloop imports and
trains the same, calling the same implementations in the same order."""

import collections
import functools
import json
import os
import subprocess
import sys
import warnings

import pluggy
import pluggy._callers
import pluggy._hooks
import pluggy._manager
import pytest

from hookloop import _pluggy, hookimpl, hookspecs
from hookloop.errors import PluginValidationError
from hookloop.manager import PluginManager, hook_names
from paths import ROOT

#: run in a fresh interpreter: ``python -c SCRIPT with|without``. Without:
#: pluggy's private names are gone before hookloop is imported (and a
#: HookCaller keeps its implementations in something that is not a list).
SCRIPT = r'''
import collections, hashlib, json, sys, warnings

if sys.argv[1] == "without":
    import pluggy, pluggy._callers, pluggy._hooks, pluggy._manager
    del pluggy._callers._multicall
    del pluggy._hooks.varnames

    class Caller(pluggy.HookCaller):
        """A HookCaller without a _hookimpls list (a list-like view instead)."""
        __slots__ = ("_store",)

        @property
        def _hookimpls(self):
            view = collections.UserList()
            view.data = self._store
            return view

        @_hookimpls.setter
        def _hookimpls(self, value):
            self._store = value

    pluggy._manager.HookCaller = Caller

import hookloop
from hookloop import _pluggy, hookimpl
from hookloop.testing import HookRecorder, parameters, tiny_loop

log = []

def plugin(tag, trylast=False):
    class P:
        name = tag

        @hookimpl(trylast=trylast)
        def on_epoch_start(self, epoch):
            log.append((tag, "on_epoch_start", epoch))

        @hookimpl(trylast=trylast)
        def before_step(self, loop):
            log.append((tag, "before_step", loop.state.global_step))

        @hookimpl(trylast=trylast)
        def compute_loss(self, network):
            log.append((tag, "compute_loss", network.name))  # None: the default answers

        @hookimpl(trylast=trylast)
        def after_backward(self, network):
            log.append((tag, "after_backward", network.name))

        @hookimpl(trylast=trylast)
        def after_step(self, loss):
            log.append((tag, "after_step", round(loss.item(), 6)))

        @hookimpl(trylast=trylast)
        def on_epoch_end(self, epoch):
            log.append((tag, "on_epoch_end", epoch))

    return P()

class Late:
    def __init__(self, tag):
        self.name = tag

    @hookimpl(trylast=True)
    def on_fit_start(self):
        log.append((self.name, "trylast on_fit_start", None))

recorder = HookRecorder()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loop = tiny_loop([recorder, plugin("A"), plugin("B"), Late("C"), Late("D")], eval_data=True)
relay = type(loop.hook.after_step).__name__
loop.fit(epochs=2)
plain = [entry for entry in log if not entry[1].startswith("trylast")]
digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in parameters(loop))).hexdigest()
print(json.dumps({
    "status": _pluggy.status(),
    "relay": relay,
    "params": digest,
    "plain": plain,
    "hooks": recorder.names(),
    "trylast": [entry[0] for entry in log if entry[1].startswith("trylast")],
    # what pluggy's absence could cause; an older Accelerate's fast-path warning is another subject
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                 and "fast path" not in str(w.message)],
}))
'''


def run(mode):
    env = {k: v for k, v in os.environ.items() if k != _pluggy.ENV}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_pluggys_privates_hookloop_imports_and_trains_the_same():
    fast, public = run("with"), run("without")
    assert fast["status"] == {"direct_calls": True, "varnames": "pluggy"}
    assert public["status"] == {"direct_calls": False, "varnames": "inspect"}
    assert (fast["relay"], public["relay"]) == ("function", "Caller")  # generated / pluggy's
    assert public["params"] == fast["params"]  # bit for bit
    assert public["plain"] == fast["plain"]
    assert public["hooks"] == fast["hooks"]
    assert len(fast["plain"]) > 100 and {e[0] for e in fast["plain"]} == {"A", "B"}
    # trylast ones too: pluggy's order, the first registered (plugins=[...]'s last) first
    assert public["trylast"] == fast["trylast"] == ["D", "C"]
    assert public["warnings"] == fast["warnings"] == []


# -- on the installed pluggy, every private is in use ------------------------


def test_the_installed_pluggy_is_a_verified_one():
    found = {
        "_multicall": _pluggy.fingerprint(pluggy._callers._multicall),
        "HookCaller.__call__": _pluggy.fingerprint(pluggy.HookCaller.__call__),
        "PluginManager._hookexec": _pluggy.fingerprint(pluggy.PluginManager._hookexec),
    }
    unverified = {k: v for k, v in found.items() if v not in _pluggy.VERIFIED[k]}
    assert not unverified, (
        f"pluggy {pluggy.__version__} differs from the code hookloop._pluggy was checked "
        f"against: {unverified}. Check the new code line by line, then add the fingerprints "
        "to hookloop._pluggy.VERIFIED."
    )
    assert _pluggy.status() == {"direct_calls": True, "varnames": "pluggy"}


class Plain:
    name = "plain"

    @hookimpl
    def after_step(self, loss):
        return loss

    @hookimpl(trylast=True)
    def on_fit_start(self, loop):
        return "plain"


class Other:
    name = "other"

    @hookimpl(trylast=True)
    def on_fit_start(self, loop):
        return "other"


def manager(*plugins):
    pm = PluginManager()
    for plugin in plugins:
        pm.register(plugin, plugin.name, "test")
    return pm


def test_the_relay_calls_plain_implementations_directly():
    pm = manager(Plain())
    assert not isinstance(pm.hook.after_step, pluggy.HookCaller)
    assert pm.hook.after_step(loop=None, batch=None, outputs=None, loss=3) == [3]
    assert _pluggy.find_varnames() is pluggy._hooks.varnames


def test_pluggys_lists_of_implementations_are_left_as_pluggy_made_them():
    pm = manager(Plain(), Other())
    alone = pluggy.PluginManager(pm.pm.project_name)  # pluggy by itself, the same registrations
    alone.add_hookspecs(hookspecs)
    for name, plugin in pm.pm.list_name_plugin():
        alone.register(plugin, name=name)
    def listed(caller):
        return [(impl.plugin_name, impl.function) for impl in caller._hookimpls]

    for hook in hook_names():
        assert listed(getattr(pm.pm.hook, hook)) == listed(getattr(alone.hook, hook)), hook
    assert pm.pm.hook.on_fit_start(loop=None) == ["plain", "other"]  # trylast: registration order


# -- each fallback, when its private is missing ------------------------------


@pytest.mark.parametrize("missing", ["absent", "_multicall", "HookCaller.__call__",
                                     "PluginManager._hookexec"])
def test_without_a_verified_multicall_the_relay_uses_pluggys_callers(monkeypatch, missing):
    if missing == "absent":
        monkeypatch.delattr(pluggy._callers, "_multicall")
    else:  # another pluggy's code there
        monkeypatch.setitem(_pluggy.VERIFIED, missing, {"0" * 16})
    assert _pluggy.multicall() is None
    pm = manager(Plain())
    assert isinstance(pm.hook.after_step, pluggy.HookCaller)
    assert pm.hook.after_step(loop=None, batch=None, outputs=None, loss=3) == [3]


def test_under_monitoring_the_relay_uses_pluggys_callers():
    pm = manager(Plain())
    undo = pm.add_hookcall_monitoring(lambda *a: None, lambda *a: None)
    assert _pluggy.multicall() is not None
    assert isinstance(pm.hook.after_step, pluggy.HookCaller)
    undo()
    assert not isinstance(pm.hook.after_step, pluggy.HookCaller)


def test_without_varnames_the_inspect_reading_is_used(monkeypatch):
    monkeypatch.delattr(pluggy._hooks, "varnames")
    assert _pluggy.find_varnames() is _pluggy.inspect_varnames
    assert _pluggy.varnames(hookspecs.after_step)[0] == ("loop", "batch", "outputs", "loss")

    class Asks:
        name = "asks"

        @hookimpl
        def after_step(self, loss, lr):
            pass

    with pytest.raises(PluginValidationError, match="'lr' that the hook does not have"):
        manager(Asks())


def wrapped(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


class Shapes:
    def method(self, loop, batch=None, *, only=1):
        pass

    @staticmethod
    def static(loop, network):
        pass

    @classmethod
    def klass(cls, loop):
        pass

    @wrapped
    def decorated(self, loss):
        pass

    def defaults_only(self=None, loss=None):
        pass

    def unusual(this, loop):  # noqa: N805 - bound, its first argument still goes
        pass

    def __call__(self, epoch, *args, **kwargs):
        pass


def function(loop, batch, /, outputs, loss=None, *rest, key, **more):
    pass


def test_the_inspect_reading_agrees_with_pluggys_varnames():
    shapes = Shapes()
    cases = [function, wrapped(function), hookspecs.after_step, hookspecs.compute_loss,
             Shapes.method, shapes.method, Shapes.static, shapes.static, Shapes.klass,
             shapes.klass, shapes.decorated, Shapes.decorated, shapes.defaults_only,
             Shapes.defaults_only, shapes.unusual, Shapes.unusual, shapes, Shapes, lambda loop, epoch=0: None, len, print,
             functools.partial(function, 1), wrapped(shapes.method)]
    cases += [getattr(hookspecs, name) for name in hook_names()]
    for case in cases:
        assert _pluggy.inspect_varnames(case) == pluggy._hooks.varnames(case), case


class ListlessCaller(pluggy.HookCaller):
    """A HookCaller that keeps its implementations in something other than a list."""

    __slots__ = ("_store",)

    @property
    def _hookimpls(self):
        view = collections.UserList()
        view.data = self._store
        return view

    @_hookimpls.setter
    def _hookimpls(self, value):
        self._store = value


def test_without_a_list_of_implementations_the_order_is_the_same_and_nothing_warns(monkeypatch):
    ordered = manager(Plain(), Other()).pm.hook.on_fit_start(loop=None)
    monkeypatch.setattr(pluggy._manager, "HookCaller", ListlessCaller)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm = manager(Plain(), Other())
    assert isinstance(pm.pm.hook.on_fit_start, ListlessCaller)
    assert pm.pm.hook.on_fit_start(loop=None) == ordered == ["plain", "other"]
    assert pm.hook.after_step(loop=None, batch=None, outputs=None, loss=3) == [3]


def test_the_switch_turns_every_private_off(monkeypatch):
    monkeypatch.setenv(_pluggy.ENV, "0")
    assert _pluggy.status() == {"direct_calls": False, "varnames": "inspect"}
    pm = manager(Plain())
    assert isinstance(pm.hook.after_step, pluggy.HookCaller)
