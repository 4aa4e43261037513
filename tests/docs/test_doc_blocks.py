"""Every Python block of README.md and docs/*.md runs as written.

Each page's blocks run in order in one namespace (a later block may use what
an earlier one defined), in a temporary working directory, after
docs/example_names.py (the names the docs use for "your model, your data").
A block that cannot run as written (it needs the model hub, a GPU, or it is an
excerpt of a larger program) is marked by the line ``<!-- fragment: why -->``
right above its fence; it is still compiled, so it must at least be Python.
"""

import re
import runpy

import pytest

from paths import ROOT, SCRIPTS  # noqa: F401

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- fragment: [^>]*-->\n)?```python\n(.*?)```", flags=re.S)


def blocks(page):
    """``(line, code, fragment)`` of every Python block of ``page``."""
    text = page.read_text()
    return [(text[:m.start()].count("\n") + 1 + bool(m.group(1)), m.group(2), bool(m.group(1)))
            for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_of_the_page_runs_as_written(page, tmp_path, monkeypatch, capsys):
    from hookloop.testing import reset_accelerate

    found = blocks(page)
    if not found:
        pytest.skip("no Python block")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")
    namespace = runpy.run_path(str(ROOT / "docs" / "example_names.py"))
    name = page.relative_to(ROOT).as_posix()
    reset_accelerate()
    try:
        for line, code, fragment in found:
            compiled = compile(code, f"{name}:{line}", "exec")  # a fragment must still be Python
            if not fragment:
                exec(compiled, namespace)
    finally:
        reset_accelerate()


def test_fragments_say_why_and_are_few():
    """A fragment marker names its reason; most blocks run."""
    every = [(page, b) for page in PAGES for b in blocks(page)]
    fragments = [(page, line) for page, (line, _, fragment) in every if fragment]
    assert len(fragments) * 4 < len(every), fragments
    for page in PAGES:
        for reason in re.findall(r"^<!-- fragment: ([^>]*)-->\n```python", page.read_text(), flags=re.M):
            assert len(reason.strip()) > 10, (page, reason)
