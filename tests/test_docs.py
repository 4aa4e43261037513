"""The hook reference stays honest: every hook documented to the template,
and listed in the README."""

import inspect
from pathlib import Path

import pytest

from hookloop import hookspecs
from hookloop.manager import hook_names

README = (Path(__file__).parent.parent / "README.md").read_text()


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_is_documented_to_the_template(hook):
    func = getattr(hookspecs, hook)
    doc = inspect.getdoc(func) or ""
    summary = doc.split("\n\n")[0].strip()
    assert summary.endswith(".") and summary[0].isupper(), f"{hook}: no summary sentence"
    for arg in inspect.signature(func).parameters:
        assert f":param {arg}:" in doc, f"{hook}: argument {arg!r} undocumented"
    if func.hookloop_spec.get("firstresult"):
        assert "Stops at the first non-None result." in doc, hook
    else:
        assert "Return value ignored." in doc, hook
    assert ".. versionadded::" in doc, hook


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_is_in_the_readme(hook):
    assert f"`{hook}" in README or f"/ `{hook}" in README or f" {hook}(" in README, hook


def test_the_architecture_names_are_kept():
    names = hook_names()
    for required in ("before_step", "after_backward", "on_epoch_end", "training_step",
                     "compute_loss", "on_exception"):
        assert required in names
