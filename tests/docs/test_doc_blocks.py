"""Every Python block of README.md, docs/*.md and the plugins' READMEs runs as
written.

Each page's blocks run in order in one namespace (a later block may use what
an earlier one defined), in a temporary working directory, after
docs/example_names.py (the names the docs use for "your model, your data"):
docs/*.md's here (README.md's each alone, in tests/docs/test_readme.py),
the plugins' READMEs in a virtual environment where the plugins are installed
(tests/manager/test_plugin_distributions.py). A block that cannot run as
written (it needs the model hub, a GPU, or it is an excerpt of a larger
program) is marked by the line ``<!-- fragment: why -->`` right above its
fence; a whole program that a slow test runs as written (on a Ray cluster,
with a torchft lighthouse) by ``<!-- runs in: TEST (why) -->``. Both are still
compiled here, so they must at least be Python (tests/scripts/doc_blocks.py).
"""

import pytest

from doc_blocks import blocks
from paths import ROOT, SCRIPTS  # noqa: F401

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLUGIN_PAGES = sorted((ROOT / "plugins").glob("*/README.md"))
#: README.md's blocks run in tests/docs/test_readme.py, each alone in a fresh interpreter
#: (more than here: no earlier block's names), once
RUN_HERE = [page for page in PAGES if page.name != "README.md"]


@pytest.mark.parametrize("page", RUN_HERE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_of_the_page_runs_as_written(page, tmp_path, monkeypatch, capsys):
    from hookloop.testing import reset_accelerate

    from doc_blocks import run_page

    if not blocks(page):
        pytest.skip("no Python block")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_accelerate()
    try:
        run_page(page, page.relative_to(ROOT).as_posix())
    finally:
        reset_accelerate()


@pytest.mark.parametrize("page", PLUGIN_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_of_a_plugin_s_readme_is_python(page):
    """(They run where the plugins are installed: tests/manager/test_plugin_distributions.py.)"""
    for block in blocks(page):
        compile(block.code, f"{page.relative_to(ROOT).as_posix()}:{block.line}", "exec")


def test_fragments_say_why_and_are_few():
    """A fragment marker names its reason; most blocks run (here, or in the slow test
    a ``runs in`` marker names)."""
    every = [(page, b) for page in [*PAGES, *PLUGIN_PAGES] for b in blocks(page)]
    fragments = [(page.relative_to(ROOT).as_posix(), b.line) for page, b in every if b.marker == "fragment"]
    assert len(fragments) * 4 < len(every), fragments
    for page, block in every:
        if block.marker:
            assert len(block.reason) > 10, (page, block.line, block.reason)


def test_a_block_that_runs_in_a_slow_test_names_a_test_that_reads_its_page():
    """docs/scaling.md's Ray and torchft programs were fragments until 0.5: the plugins'
    tests ran cousins of them, and as written they failed."""
    named = [(page, b) for page in [*PAGES, *PLUGIN_PAGES] for b in blocks(page) if b.marker == "runs in"]
    assert {page.relative_to(ROOT).as_posix() for page, _ in named} >= {
        "docs/scaling.md", "plugins/hookloop-ray/README.md", "plugins/hookloop-torchft/README.md"}
    for page, block in named:
        test = block.reason.split()[0]
        path = next((folder / test for folder in (page.parent, ROOT) if (folder / test).is_file()), None)
        assert path is not None, f"{page}:{block.line}: no test {test}"
        assert page.name in path.read_text(), f"{test} does not read {page.name}"
