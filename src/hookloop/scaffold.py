"""``hookloop new-plugin NAME``: write a ready plugin distribution.

::

    hookloop new-plugin demo-thing            # writes ./hookloop-demo-thing/
    pip install './hookloop-demo-thing[test]' # the plugin, and pytest for its tests
    pytest hookloop-demo-thing/tests

The distribution has a ``pyproject.toml`` declaring the entry point
(group ``hookloop``, name ``NAME``), a module with one documented hook
implementation, a README and a test written with :mod:`hookloop.testing`
that passes as generated; its ``test`` extra brings pytest, so that the
recipe above works in a fresh virtual environment. Users switch the plugin
on with ``Loop(plugins=["NAME"])`` (and install it without the extra).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:  # names for the annotations only
    import argparse

#: lower-case words joined by single hyphens: a valid entry-point, distribution
#: and (with underscores) module name
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

#: names a user's ``plugins=["name"]`` would resolve to something else
RESERVED = {"supervised", "gan", "recorder"}


def names(name: str) -> dict[str, str]:
    """The distribution, module, class and entry-point names for ``name``,
    or ``ValueError`` saying what a valid name is."""
    if not NAME_PATTERN.match(name or ""):
        raise ValueError(
            f"plugin name {name!r}: use lower-case letters and digits, words joined by "
            "single hyphens, starting with a letter (e.g. 'demo-thing')"
        )
    from .plugins import BUILTINS

    if name in BUILTINS or name in RESERVED:
        raise ValueError(f"plugin name {name!r} is taken by a built-in plugin: choose another")
    module = "hookloop_" + name.replace("-", "_")
    return {
        "name": name,
        "distribution": f"hookloop-{name}",
        "module": module,
        "cls": "".join(part.capitalize() for part in name.split("-")),
        "test": f"test_{name.replace('-', '_')}.py",
        "hookloop_version": __version__,
    }


PYPROJECT = '''\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{distribution}"
version = "0.1.0"
description = "A hookloop plugin: {name}."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["hookloop>={hookloop_version}"]

# pip install './{distribution}[test]': what its tests need (hookloop.testing is a pytest plugin)
[project.optional-dependencies]
test = ["pytest>=8"]

# hookloop finds the plugin here; users switch it on with Loop(plugins=["{name}"])
[project.entry-points.hookloop]
{name} = "{module}:{cls}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

MODULE = '''\
"""{cls}: a hookloop plugin.

Switch it on with ``Loop(..., plugins=["{name}"])``, with options
``Loop(..., plugins=[("{name}", {{"every": 10}})])``, or in code
``Loop(..., plugins=[{cls}(every=10)])``.
"""

from hookloop import hookimpl

__version__ = "0.1.0"


class {cls}:
    """Record the training loss every ``every`` optimizer updates.

    :param every: updates between two records (reading a loss waits for the
        GPU, so not every step).

    ``self.losses`` holds ``(global_step, loss)`` pairs: the loss of the
    batch that completed the update.
    """

    #: the name users give in plugins=[...], also the entry point's name
    name = "{name}"
    #: whether the plugin changes the numbers of a training run (loss,
    #: gradients, weights, data, stopping); ``hookloop plugins`` shows it
    changes_training = False
    #: set ``autoload = True`` only if the plugin merely observes (a tracker, a
    #: profiler): it then acts as soon as it is installed. A plugin that changes
    #: training must wait to be named.
    autoload = False

    def __init__(self, every=10):
        self.every = every
        self.losses = []

    @hookimpl
    def after_step(self, loop, loss):
        """Called after every trained batch (see ``hookloop hooks``): a hook
        implementation takes only the hook arguments it needs, by name.

        Under gradient accumulation (``Accelerator(gradient_accumulation_steps=k)``)
        ``global_step`` counts updates, so it stays the same for the ``k``
        batches of a group: act only on the batch that completed an update
        (``sync_gradients``), or "every N steps" fires ``k`` times."""
        if not loop.accelerator.sync_gradients:
            return
        step = loop.state.global_step
        if step % self.every == 0:
            self.losses.append((step, loss.item()))
            loop.print(f"{name}: step {{step}} loss {{self.losses[-1][1]:.4f}}")  # main process only
'''

TEST = '''\
"""Tests for {distribution}, with hookloop's kit (``hookloop.testing``, a
pytest plugin: its fixtures need no import). Install first, with the
``test`` extra (pytest): ``pip install './{distribution}[test]'``, then
``pytest {distribution}/tests``."""

from {module} import {cls}


def test_records_the_loss_every_n_steps(tiny_loop, hookloop_recorder):
    plugin = {cls}(every=2)
    loop = tiny_loop([plugin, hookloop_recorder])  # 64 examples, batches of 8
    loop.fit(epochs=1)
    assert [step for step, _ in plugin.losses] == [2, 4, 6, 8]
    # the losses are those the loop passed to after_step at those steps
    seen = [call["loss"].item() for call in hookloop_recorder.calls_of("after_step")]
    assert [loss for _, loss in plugin.losses] == seen[1::2]


def test_counts_updates_under_gradient_accumulation(tiny_loop, hookloop_recorder):
    """With 2 batches per update, global_step stays the same for both batches
    of a group: the plugin acts once per update, on the batch that completed it."""
    from accelerate import Accelerator

    plugin = {cls}(every=2)
    loop = tiny_loop([plugin, hookloop_recorder], accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(epochs=1)  # 8 batches: 4 updates
    assert [step for step, _ in plugin.losses] == [2, 4]
    seen = [call["loss"].item() for call in hookloop_recorder.calls_of("after_step")]
    assert [loss for _, loss in plugin.losses] == [seen[3], seen[7]]


def test_installed_it_acts_only_when_named(monkeypatch, fresh_accelerator):
    """Installed, the plugin changes nobody's training until it is named: a
    plain Loop, with the user controls of installed plugins cleared, does not
    load it (this fails if the plugin sets autoload = True)."""
    from hookloop.manager import discover
    from hookloop.testing import tiny_loop

    for variable in ("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "HOOKLOOP_LOAD_PLUGINS",
                     "HOOKLOOP_BLOCK_PLUGINS"):
        monkeypatch.delenv(variable, raising=False)
    assert "{name}" in [item.name for item in discover()], "install it first: pip install ./{distribution}"
    assert "{name}" not in tiny_loop().plugins.names(), "the plugin loads without being named"
    named = tiny_loop([("{name}", {{"every": 4}})])
    assert isinstance(named.plugins.get("{name}"), {cls})
    assert named.plugins.get("{name}").every == 4
'''

README = '''\
# {distribution}

A [hookloop](https://pypi.org/project/hookloop/) plugin: records the training loss every
`every` steps.

```bash
pip install ./{distribution}
```

```python
loop = Loop(..., plugins=["{name}"])                    # or [("{name}", {{"every": 10}})]
```

Installing it changes nothing until it is named in `plugins=[...]`; `hookloop plugins`
lists it. Tests: `pip install './{distribution}[test]'` (the `test` extra brings pytest),
then `pytest {distribution}/tests`.
'''


def write(name: str, directory: str | os.PathLike[str] = ".") -> Path:
    """Write the distribution for ``name`` under ``directory``; return its
    folder. Refuses to overwrite an existing folder."""
    n = names(name)
    root = Path(directory) / n["distribution"]
    if root.exists():
        raise FileExistsError(f"{root} already exists: remove it or choose another --dir")
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"src/{n['module']}/__init__.py": MODULE,
        f"tests/{n['test']}": TEST,
    }
    for rel, template in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**n))
    return root


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``new-plugin`` to the ``hookloop`` command's subcommands."""
    p = sub.add_parser("new-plugin", help="write a ready plugin distribution",
                       description="Write hookloop-NAME/: a plugin distribution (an entry point, a "
                       "documented hook, a README, tests) that installs and passes its own tests.",
                       epilog="then: pip install './hookloop-NAME[test]' && pytest hookloop-NAME/tests "
                       "(the test extra brings pytest)")
    p.add_argument("name", help="the plugin's name, e.g. demo-thing (lower case, hyphens)")
    p.add_argument("--dir", default=".", help="where to write hookloop-NAME/ (default: here)")
    p.set_defaults(func=_cmd_new_plugin)


def _cmd_new_plugin(args: argparse.Namespace) -> int:
    try:
        root = write(args.name, args.dir)
    except ValueError as exc:
        print(f"hookloop new-plugin: {exc}", file=sys.stderr)
        return 2
    except FileExistsError as exc:
        print(f"hookloop new-plugin: {exc}", file=sys.stderr)
        return 1
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        print(f"wrote {path}")
    print(f"next: pip install {local_path(root, extra='test')} && pytest {shlex.quote(str(root / 'tests'))}")
    return 0


def local_path(path: str | os.PathLike[str], extra: str | None = None) -> str:
    """``path`` as pip reads it as a directory, not a name to look up on the
    package index: ``hookloop-x`` becomes ``./hookloop-x`` (with ``extra``,
    ``./hookloop-x[test]``); quoted for a shell (zsh globs the brackets)."""
    text = str(path)
    if not os.path.isabs(text) and not text.startswith(("./", "../")):
        text = "./" + text
    if extra:
        text += f"[{extra}]"
    return shlex.quote(text)
