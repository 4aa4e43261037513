"""hookloop's annotations as a plugin author's type checker sees them: the
package ships ``py.typed``, and a typed plugin using ``loop.state.global_step``
checks clean under ``mypy --strict`` while a misspelt attribute is rejected.

mypy's first run analyses torch (about a minute and a half); its cache lives
in the system temporary folder, so later runs take seconds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paths import ROOT

PLUGIN = '''\
from hookloop import Loop, LoopState, hookimpl
from hookloop.protocols import LoopLike


def as_the_hooks_see_it(loop: Loop) -> LoopLike:
    return loop  # every Loop is what the hook specifications annotate ``loop`` with


class EveryTen:
    @hookimpl
    def after_step(self, loop: Loop) -> None:
        state: LoopState = loop.state
        step: int = state.{attribute}
        if step % 10 == 0:
            loop.print(f"step {{step}} of {{loop.total_steps}}")
            loop.stop("enough")
'''


def mypy_cache(settings):
    """Warm from the second run on (mypy reads torch's stubs in ~1 min cold, ~20 s
    warm): under the checkout's .mypy_cache, one folder per settings and Python
    (CI runs two Pythons' tests in one checkout at once)."""
    return ROOT / ".mypy_cache" / f"hookloop-tests-{settings}-{sys.version_info[0]}.{sys.version_info[1]}"


def mypy(*paths):
    pytest.importorskip("mypy")
    cache = mypy_cache("plugin-author")
    # the plugin author's settings, not the project's: strict for their
    # file, hookloop read from its annotations without checking its bodies
    command = [sys.executable, "-m", "mypy", "--config-file", os.devnull,
               "--strict", "--follow-imports=silent", "--ignore-missing-imports",
               "--no-error-summary", "--cache-dir", str(cache), *map(str, paths)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    return done.returncode, done.stdout + done.stderr


def test_the_package_ships_py_typed():
    assert (ROOT / "src" / "hookloop" / "py.typed").is_file()
    assert 'hookloop = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.slow  # mypy analyses torch: ~1 min cold; the same verdict on every Python (python_version = 3.10)
def test_a_typed_plugin_checks_clean_and_a_misspelt_attribute_is_rejected(tmp_path):
    good, bad = tmp_path / "good_plugin.py", tmp_path / "bad_plugin.py"
    good.write_text(PLUGIN.format(attribute="global_step"))
    bad.write_text(PLUGIN.format(attribute="global_stepp"))
    status, output = mypy(good, bad)
    errors = [line for line in output.splitlines() if ": error:" in line]
    assert status == 1
    # (by file name: mypy's cache may name the same module's file of an earlier run)
    assert [Path(e.split(":")[0]).name for e in errors] == [bad.name], output  # good is clean
    assert '"LoopState" has no attribute "global_stepp"' in errors[0]


@pytest.mark.slow  # mypy analyses torch: ~1 min cold; the same verdict on every Python (python_version = 3.10)
def test_the_package_checks_clean_with_the_project_configuration():
    # what pyproject.toml's [tool.mypy] says is checked: any new error fails here
    pytest.importorskip("mypy")
    cache = mypy_cache("project")
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Success: no issues found" in output, output
