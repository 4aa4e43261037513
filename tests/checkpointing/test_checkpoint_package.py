"""The shape of hookloop.checkpointing: one role per module, no import of a
plugin or of the package root, no module-level cache; the collective helper,
find() + load(staged=...), a resume that opens each file once (an audit hook),
and hookloop.rng.keep_rng()."""

import ast
import os
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hookloop import checkpointing, hookimpl
from hookloop.checkpointing import CheckpointError, CheckpointPolicy, collective, resume as loading
from hookloop.plugins import Checkpoint
from hookloop.rng import data_generators, keep_rng
from hookloop.testing import reset_accelerate, tiny_loop
from paths import ROOT

SRC = ROOT / "src" / "hookloop"


def imported_modules(path: Path, package: str) -> set[str]:
    """The hookloop modules ``path`` imports (top level or lazily), resolved."""
    tree = ast.parse(path.read_text())
    here = package.split(".")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out |= {f"{target}.{a.name}" for a in node.names} | {target}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "hookloop" or m.startswith("hookloop.")}


def test_the_checkpoint_package_imports_no_plugin_and_not_the_package_root():
    for path in sorted((SRC / "checkpointing").glob("*.py")):
        found = imported_modules(path, "hookloop.checkpointing")
        assert not [m for m in found if m.startswith("hookloop.plugins")], path.name
        assert "hookloop" not in found, path.name  # (from .. import X with X not a module)
        assert not [m for m in found if m.startswith("hookloop.loop")], path.name
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{path.name} has no docstring saying its role"


def test_random_states_know_nothing_of_checkpoints():
    found = imported_modules(SRC / "rng.py", "hookloop.rng")
    assert not [m for m in found if "checkpoint" in m], found


def test_no_module_keeps_a_staged_checkpoint():
    assert not hasattr(loading, "_STAGED") and not hasattr(checkpointing, "_STAGED")


def test_the_checkpoint_plugin_is_the_policy_the_io_layer_finds(fresh_accelerator, isolated_plugins):
    class Other(CheckpointPolicy):
        name = "other-policy"

        def directory(self, loop):
            return Path("/nowhere")

        @hookimpl
        def on_fit_start(self):
            pass

    first, second = Checkpoint(dir="a", signals=None), Other()
    loop = tiny_loop([first, second])
    assert isinstance(first, CheckpointPolicy)
    assert checkpointing.checkpoint_plugins(loop) == [first, second]
    assert checkpointing.checkpoint_root(loop) == Path("a")


# -- every rank fails together (one process: no communication) --------------------------


def test_every_rank_raises_an_exception_as_itself():
    error = CheckpointError("mine")
    with pytest.raises(CheckpointError) as info, collective.every_rank():
        raise error
    assert info.value is error


def test_every_rank_raises_a_described_failure_as_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="^cannot write: OSError: full$"):
        with collective.every_rank(catch=OSError, describe=lambda e: f"cannot write: OSError: {e}"):
            raise OSError("full")


def test_every_rank_lets_other_exceptions_through_and_can_only_tell():
    with pytest.raises(KeyError), collective.every_rank():
        raise KeyError("not caught")
    with collective.every_rank(raise_error=False) as outcome:
        raise CheckpointError("told")
    assert outcome.error == "told"
    with collective.every_rank(raise_error=False) as outcome:
        pass
    assert outcome.error is None


# -- find() and load(staged=...) read a checkpoint once -----------------------------------


def make(root, resume_from=None):
    reset_accelerate()
    return tiny_loop([Checkpoint(dir=root, every_steps=2, signals=None)], accelerator=Accelerator(),
                     resume_from=resume_from)


def test_find_returns_what_it_staged_and_load_does_not_read_it_again(tmp_path, monkeypatch,
                                                                       isolated_plugins):
    make(tmp_path).fit(max_steps=4)
    path, staged = checkpointing.find("latest", tmp_path)
    assert path == tmp_path / "step-00000004" and staged.path == path
    assert checkpointing.resolve("latest", tmp_path) == path
    assert checkpointing.find("latest", tmp_path / "empty") == (None, None)
    assert checkpointing.find(path, tmp_path) == (path, None)  # a checkpoint's path: unread

    loop = make(tmp_path)
    reads = []
    real_stage = loading.stage
    monkeypatch.setattr(loading, "stage", lambda *a, **k: reads.append(a) or real_stage(*a, **k))
    resume = checkpointing.load(loop, path, staged=staged)
    assert reads == [] and resume.path == path and loop.state.global_step == 4
    checkpointing.load(loop, path)  # nothing given: read here
    assert len(reads) == 1


# -- a resume opens each file once ---------------------------------------------------------

_RECORDERS: list[list[str]] = []  # (an audit hook cannot be removed: it records while one is here)


def _audit(event, args):
    if event == "open" and _RECORDERS and isinstance(args[0], (str, bytes, os.PathLike)):
        _RECORDERS[-1].append(os.path.realpath(os.fsdecode(args[0])))  # (an int: an fd already open)


sys.addaudithook(_audit)


class StopRecording:
    """Ends the recording when the first epoch starts (after on_fit_start's
    root set-up and rotation, and the sanity check)."""

    def __init__(self, opened):
        self.opened = opened

    @hookimpl
    def on_epoch_start(self):
        if self.opened in _RECORDERS:
            _RECORDERS.remove(self.opened)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_resume_opens_latest_once_the_manifest_once_and_no_checkpoint_file_twice(tmp_path, asynchronous,
                                                                                  isolated_plugins):
    def run(resume_from=None, opened=None):
        reset_accelerate()
        plugins = [Checkpoint(dir=tmp_path, every_steps=2, keep_last=2, signals=None,
                              asynchronous=asynchronous)]
        return tiny_loop(plugins + ([StopRecording(opened)] if opened is not None else []),
                         accelerator=Accelerator(), resume_from=resume_from, eval_data=True)

    run().fit(max_steps=4)
    opened: list[str] = []
    _RECORDERS.append(opened)
    try:
        loop = run("latest", opened)
        loop.fit(max_steps=6)
    finally:
        if opened in _RECORDERS:
            _RECORDERS.remove(opened)
    assert loop.resumed_from == tmp_path / "step-00000004"
    counts = Counter(opened)
    checkpoint = os.path.realpath(tmp_path / "step-00000004")
    assert counts[os.path.realpath(tmp_path / "latest")] == 1
    assert counts[os.path.join(checkpoint, "hookloop.json")] == 1
    files = {p.name for p in (tmp_path / "step-00000004").iterdir()}
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "hookloop-rank0.safetensors"} <= files
    for name in files - {"hookloop.json"}:  # each file of the checkpoint opened once
        assert counts[os.path.join(checkpoint, name)] == 1, (name, counts)
    in_checkpoints = {p: n for p, n in counts.items() if p.startswith(os.path.realpath(tmp_path) + os.sep)
                      and "/step-" in p}
    assert max(in_checkpoints.values()) == 1, in_checkpoints  # the other checkpoint's manifest too


# -- keep_rng ------------------------------------------------------------------------------


def test_keep_rng_puts_the_global_and_the_loaders_random_states_back():
    data = DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True,
                      generator=torch.Generator().manual_seed(1))
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    gen = data_generators(data)["generator"].get_state()
    with pytest.raises(RuntimeError), keep_rng(data, None):
        random.random(), np.random.rand(), torch.rand(1), list(data)
        raise RuntimeError("the body failed")
    assert random.getstate() == state[0] and (np.random.get_state()[1] == state[1]).all()
    assert torch.equal(torch.get_rng_state(), state[2])
    assert torch.equal(data_generators(data)["generator"].get_state(), gen)
