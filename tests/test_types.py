"""hookloop's annotations as a plugin author's type checker sees them: the
package ships ``py.typed``, and a typed plugin using ``loop.state.global_step``
checks clean under ``mypy --strict`` while a misspelt attribute is rejected.

mypy's first run analyses torch (about 45 s here), once for both checks; its
cache lives in the checkout's .mypy_cache, so later runs take seconds."""

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


def mypy_cache():
    """Warm from the second run on (mypy reads torch's stubs in ~1 min cold, ~20 s
    warm): under the checkout's .mypy_cache, one folder per Python (CI runs two
    Pythons' tests in one checkout at once)."""
    return ROOT / ".mypy_cache" / f"hookloop-tests-{sys.version_info[0]}.{sys.version_info[1]}"


def test_the_package_ships_py_typed():
    assert (ROOT / "src" / "hookloop" / "py.typed").is_file()
    assert 'hookloop = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.slow  # mypy analyses torch: ~1 min cold; the same verdict on every Python (python_version = 3.10)
def test_the_package_checks_clean_and_a_typed_plugin_too_while_a_misspelt_attribute_is_rejected(tmp_path):
    """One mypy run (it analyses torch once): what pyproject.toml's [tool.mypy]
    says is checked, the package, with no error (any new one fails here); and
    two plugins of an author under ``--strict`` (the configuration's global
    setting), the good one clean, the misspelt attribute of the other rejected."""
    pytest.importorskip("mypy")
    good, bad = tmp_path / "good_plugin.py", tmp_path / "bad_plugin.py"
    good.write_text(PLUGIN.format(attribute="global_step"))
    bad.write_text(PLUGIN.format(attribute="global_stepp"))
    package = sorted((ROOT / "src" / "hookloop").rglob("*.py"))
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(mypy_cache()), str(ROOT / "src" / "hookloop"), str(good), str(bad)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if ": error:" in line]
    assert done.returncode == 1, output
    # (by file name: mypy's cache may name the same module's file of an earlier run)
    assert [Path(e.split(":")[0]).name for e in errors] == [bad.name], output  # the package and good are clean
    assert '"LoopState" has no attribute "global_stepp"' in errors[0]
    assert f"Found 1 error in 1 file (checked {len(package) + 2} source files)" in output, output
