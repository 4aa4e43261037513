"""The plugins of plugins/ as users get them: ``pip install`` into a fresh
virtual environment, then ``hookloop plugins``, training runs, the controls,
a broken distribution, the scaffold's output and each plugin's own tests.

One virtual environment for the whole session (``plugin_venv``), made fast:
``python -m venv --without-pip`` plus a ``.pth`` file that adds this
interpreter's site-packages (torch, accelerate, pytest, pip, setuptools and
hookloop itself) after the new environment's own. ``--system-site-packages``
would not do: made from a virtualenv's python it exposes the *base*
interpreter's site-packages, not the virtualenv's. Distributions install with
``pip install --no-deps --no-build-isolation --no-index`` (no network) from
copies of their folders, so no ``build/`` lands in the source tree.

What pip installs into the new environment comes first on its ``sys.path``
and is the only thing ``pip uninstall`` there can remove; so the plugins of
plugins/ must not be installed in the interpreter running these tests (CI
runs their test suites here, in the new environment, instead).
"""

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from paths import ROOT, SCRIPTS  # noqa: F401

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

SCRIPT = ROOT / "tests" / "scripts" / "plugin_checks.py"
#: runs a Markdown page's Python blocks as written (tests/docs/test_doc_blocks.py's rule)
DOC_BLOCKS = ROOT / "tests" / "scripts" / "doc_blocks.py"
PLUGIN_DIRS = sorted((ROOT / "plugins").glob("hookloop-*"))
#: entry-point name -> (distribution, version, object) read from each pyproject.toml
DECLARED = {}
for _folder in PLUGIN_DIRS:
    _project = tomllib.loads((_folder / "pyproject.toml").read_text())["project"]
    for _name, _obj in _project["entry-points"]["hookloop"].items():
        DECLARED[_name] = (_project["name"], _project["version"], _obj)
BEHAVIOUR_CHANGING = ("ema", "wgan-gp", "early-stopping")
#: not autoloaded either: they act only when named (Ray's reports, torchft's quorum)
OPT_IN = (*BEHAVIOUR_CHANGING, "ray-report", "fault-tolerant")
OBSERVERS = ("profiler",)
TIMEOUT = 300
#: a plugin's own tests, one distribution at a time (hookloop-ray's starts a Ray cluster twice)
OWN_TESTS_TIMEOUT = 600
SETUPTOOLS_CHECK = ("import setuptools, sys; from setuptools.command.bdist_wheel import bdist_wheel; "
                    "sys.exit(int(setuptools.__version__.split('.')[0]) < 77)")


class Venv:
    """A virtual environment on top of this interpreter's packages."""

    def __init__(self, path: Path):
        self.path = path
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLOOP_")}
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
        self.python = str(path / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
        purelib = self.run("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
        # a .pth line starting with "import" runs at start-up; addsitedir also
        # processes the parent's own .pth files (hookloop's editable install)
        parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
        Path(purelib, "_hookloop_test_parent.pth").write_text(
            "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in parents) + "\n")
        # offline builds need a setuptools that builds wheels itself (>= 70.1) and
        # reads the SPDX license strings of plugins/ (>= 77); else pip fetches one
        self.isolation = ["--no-build-isolation", "--no-index"]
        if self.run("-c", SETUPTOOLS_CHECK, check=False).returncode != 0:
            self.isolation = []

    def run(self, *args, env=None, check=True, cwd=None, timeout=TIMEOUT):
        result = subprocess.run([self.python, *args], capture_output=True, text=True, cwd=cwd,
                                env={**self.env, **(env or {})},
                                timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}\n"
                                 f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
        return result

    def install(self, *folders, tmp):
        copies = []
        for folder in folders:
            copy = Path(tmp) / folder.name
            if not copy.exists():
                shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(
                    "build", "*.egg-info", "__pycache__", ".pytest_cache"))
            copies.append(str(copy))
        self.run("-m", "pip", "install", "--quiet", "--no-deps", *self.isolation, *copies)

    def uninstall(self, *distributions):
        self.run("-m", "pip", "uninstall", "--quiet", "--yes", *distributions)

    def plugins(self, **env):
        """``hookloop plugins --json``, by name."""
        out = self.run("-m", "hookloop.cli", "plugins", "--json", env=env).stdout
        return {row["name"]: row for row in json.loads(out)}

    def check(self, what, tmp, *args):
        out = Path(tmp) / f"{what}.json"
        self.run(str(SCRIPT), what, str(out), *args)
        return json.loads(out.read_text())


@pytest.fixture(scope="session")
def plugin_venv(tmp_path_factory):
    here = [d for d, _, _ in DECLARED.values() if _installed(d)]
    if here:
        pytest.fail(f"{', '.join(here)} installed in the interpreter running the tests: the "
                    "virtual-environment tests need an environment without them (pip uninstall "
                    "them; these tests install them in a fresh environment and run their tests)")
    assert set(DECLARED) >= {*OPT_IN, *OBSERVERS}
    tmp = tmp_path_factory.mktemp("plugin-venv")
    venv = Venv(tmp / "venv")
    venv.tmp = tmp
    before = venv.run("-c", "from importlib.metadata import entry_points as e; "
                            "print(' '.join(p.name for p in e(group='hookloop')))").stdout.split()
    assert not set(DECLARED) & set(before), "the new environment sees plugins before installing"
    venv.install(*PLUGIN_DIRS, tmp=tmp)
    return venv


def _installed(distribution):
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_pip_install_lists_each_plugin_with_its_distribution_and_version(plugin_venv):
    rows = plugin_venv.plugins()
    for name, (distribution, version, obj) in DECLARED.items():
        row = rows[name]
        assert (row["source"], row["distribution"], row["version"], row["object"]) == \
            ("entry point", distribution, version, obj)
        assert row["hooks"], name
    for name in OPT_IN:
        assert rows[name]["status"] == "installed", name
        assert "acts only when named" in rows[name]["reason"]
    assert rows["wgan-gp"]["hooks"] == ["compute_loss"]
    assert rows["profiler"]["status"] == "active"
    assert "autoload = True" in rows["profiler"]["reason"]


@pytest.mark.slow  # pip installs and fresh interpreters, 10-20 s each
def test_uninstalling_removes_it(plugin_venv):
    plugin_venv.uninstall("hookloop-early-stopping")
    try:
        rows = plugin_venv.plugins()
        assert "early-stopping" not in rows and "ema" in rows
    finally:  # for the tests after this one
        plugin_venv.install(ROOT / "plugins" / "hookloop-early-stopping", tmp=plugin_venv.tmp)


@pytest.mark.slow  # pip installs and fresh interpreters, 10-20 s each
def test_installed_but_not_switched_on_training_is_bit_for_bit_the_same(plugin_venv, tmp_path):
    # without the plugins: this interpreter (the fixture checked they are not here)
    out = tmp_path / "bare.json"
    subprocess.run([sys.executable, str(SCRIPT), "runs", str(out)], check=True, timeout=TIMEOUT,
                   env={**plugin_venv.env}, capture_output=True)
    bare = json.loads(out.read_text())
    installed = plugin_venv.check("runs", tmp_path, "--switched-on")
    for case in ("supervised", "gan"):
        without, with_ = bare[case], installed[case]
        assert with_["params"] == without["params"], case
        assert with_["metrics"] == without["metrics"] and with_["global_step"] == without["global_step"]
        assert not set(OPT_IN) & set(with_["plugins"])
        assert "profiler" in with_["plugins"]  # the observer acted, and changed no number
    # switched on, each acts
    supervised, gan = installed["supervised"], installed["gan"]
    ema = installed["ema"]
    assert "ema" in ema["plugins"]
    assert ema["params"] == supervised["params"]  # it trains the same weights...
    assert ema["metrics"] != supervised["metrics"]  # ...and evaluates their average
    stopped = installed["early-stopping"]
    assert (stopped["global_step"], supervised["global_step"]) == (2 * 4, 3 * 4)
    assert installed["wgan-gp"]["params"] != gan["params"]


@pytest.mark.parametrize("folder", PLUGIN_DIRS, ids=lambda folder: folder.name)
def test_each_plugin_s_readme_runs_as_written(plugin_venv, folder, tmp_path):
    """Every Python block of the plugin's README, in order, after docs/example_names.py,
    with the plugins installed (0.4: `Loop(..., plugins=["ema"])`, an Ellipsis for the
    model; never run). A whole program that needs a Ray cluster or a torchft lighthouse
    is marked ``runs in`` and runs in the plugin's own slow test."""
    from doc_blocks import blocks

    expected = sum(block.marker is None for block in blocks(folder / "README.md"))
    if not expected:
        pytest.skip("no block to run here (none, or whole programs its own slow tests run)")
    done = plugin_venv.run(str(DOC_BLOCKS), str(folder / "README.md"), cwd=tmp_path,
                           env={"HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"})
    assert done.stdout.split()[-1] == str(expected), done.stdout[-2000:]


def test_autoload_switch_allow_list_and_blocking(plugin_venv, tmp_path):
    c = plugin_venv.check("controls", tmp_path)
    active = {label: "profiler" in v["unnamed"] for label, v in c.items()}
    assert active == {"default": True, "autoload off": False, "allow none": False,
                      "allow profiler": True, "allow ema": False, "block profiler": False}
    status = {label: v["status"]["profiler"] for label, v in c.items()}
    assert status == {"default": "active", "autoload off": "installed", "allow none": "installed",
                      "allow profiler": "active", "allow ema": "installed",
                      "block profiler": "blocked"}
    assert "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD is set" in c["autoload off"]["reason"]["profiler"]
    assert "not in HOOKLOOP_LOAD_PLUGINS" in c["allow none"]["reason"]["profiler"]
    # naming still works when autoload is off; the allow-list never switches on a changer
    assert "profiler" in c["autoload off"]["named"] and "profiler" in c["allow none"]["named"]
    assert "ema" not in c["allow ema"]["unnamed"] and c["allow ema"]["status"]["ema"] == "installed"
    # blocking in code, Loop(block=[...]), works like the variable
    assert "profiler" not in c["default"]["blocked_in_code"]


BROKEN = {
    "pyproject.toml": """\
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "hookloop-broken-demo"
        version = "0.3.0"

        [project.entry-points.hookloop]
        broken = "hookloop_broken_demo:Plugin"
        """,
    "hookloop_broken_demo.py": "import a_module_nobody_installed  # noqa\n",
}


@pytest.mark.slow  # pip installs and fresh interpreters, 10-20 s each
def test_a_broken_distribution_is_named_and_takes_nothing_down(plugin_venv, tmp_path):
    folder = tmp_path / "hookloop-broken-demo"
    folder.mkdir()
    for name, text in BROKEN.items():
        (folder / name).write_text(textwrap.dedent(text))
    plugin_venv.install(folder, tmp=tmp_path / "copies")
    try:
        b = plugin_venv.check("broken", tmp_path)
    finally:
        plugin_venv.uninstall("hookloop-broken-demo")
    row = b["row"]  # what `hookloop plugins` prints
    assert (row["status"], row["distribution"], row["version"]) == ("error", "hookloop-broken-demo", "0.3.0")
    assert "ModuleNotFoundError" in row["reason"] and "a_module_nobody_installed" in row["reason"]
    # not named: a warning naming it; the others still load
    assert any("hookloop-broken-demo 0.3.0" in w and "hookloop_broken_demo:Plugin" in w
               for w in b["warnings"])
    assert "profiler" in b["unnamed"] and "ema" in b["ema"]
    # named: an error naming the distribution and the entry point
    error = b["error"]
    assert error is not None and (error["distribution"], error["entry_point"]) == \
        ("hookloop-broken-demo", "hookloop_broken_demo:Plugin")
    assert "'broken'" in error["message"] and "hookloop-broken-demo 0.3.0" in error["message"]
    assert "a_module_nobody_installed" in error["message"]


@pytest.mark.slow  # pip installs and fresh interpreters, 10-20 s each
def test_new_plugin_output_installs_and_its_tests_pass(plugin_venv, tmp_path, capsys):
    from hookloop.cli import main

    assert main(["new-plugin", "demo-thing", "--dir", str(tmp_path)]) == 0
    folder = tmp_path / "hookloop-demo-thing"
    assert f"wrote {folder / 'pyproject.toml'}" in capsys.readouterr().out
    plugin_venv.install(folder, tmp=tmp_path / "copies")
    try:
        tests = plugin_venv.run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder / "tests"),
                                cwd=folder, check=False)
    finally:
        plugin_venv.uninstall("hookloop-demo-thing")
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert "3 passed" in tests.stdout


@pytest.mark.slow  # pip installs and fresh interpreters, 10-20 s each
# one test per distribution (Ray's and torchft's suites take a minute each): the two
# xdist workers run them side by side, each in its worker's plugin_venv
@pytest.mark.parametrize("folder", PLUGIN_DIRS, ids=[d.name for d in PLUGIN_DIRS])
def test_each_plugin_s_own_tests_pass_once_installed(plugin_venv, folder):
    tests = plugin_venv.run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder / "tests"),
                            cwd=folder, check=False, timeout=OWN_TESTS_TIMEOUT)
    # (without torchft's lighthouse log, thousands of lines that would hide the failure)
    said = "\n".join(line for line in tests.stdout.splitlines() if "[INFO] [torchft::" not in line)
    assert tests.returncode == 0, f"{folder.name}:\n{said[-6000:]}"
    assert " passed" in tests.stdout and "failed" not in tests.stdout and "skipped" not in tests.stdout, \
        f"{folder.name}:\n{tests.stdout[-3000:]}"
