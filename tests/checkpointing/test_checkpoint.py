"""The Checkpoint plugin and hookloop.checkpointing, in one process: what a
checkpoint holds, rotation, exact resume, plugin state, strictness."""

import json
import warnings

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from hookloop import hookimpl
from hookloop.checkpointing import CheckpointError, read_manifest
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate, tiny_loop

EPOCHS = 2  # tiny_loop's warm-up schedule spans 2 epochs of 8 steps


def params(loop):
    return {k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()}


def differing(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


def make(root, *plugins, accum=1, resume_from=None, every_steps=2, keep_last=3, **kwargs):
    reset_accelerate()
    checkpoint = Checkpoint(dir=root, every_steps=every_steps, keep_last=keep_last, signals=None)
    return tiny_loop([checkpoint, *plugins],
                     accelerator=Accelerator(gradient_accumulation_steps=accum), eval_data=True,
                     resume_from=resume_from, **kwargs)


class Counter:
    """A stateful plugin: counts steps, keeps a tensor and assorted data."""

    name = "counter"

    def __init__(self):
        self.steps = 0
        self.total = torch.zeros(3)
        self.loaded = None

    @hookimpl
    def after_step(self):
        self.steps += 1
        self.total += 1

    def state_dict(self):
        return {"steps": self.steps, "total": self.total, "pair": (1, "a"),
                "table": {3: np.arange(4), "x": [1.5, None, True]}}

    def load_state_dict(self, state):
        self.loaded = state
        self.steps = state["steps"]
        self.total = state["total"].clone()


_reference = {}


def reference(accum):
    if accum not in _reference:
        reset_accelerate()
        loop = tiny_loop(accelerator=Accelerator(gradient_accumulation_steps=accum), eval_data=True)
        loop.fit(epochs=EPOCHS)
        _reference[accum] = params(loop)
    return _reference[accum]


# -- what is written -------------------------------------------------------------


def test_a_checkpoint_holds_accelerates_files_and_hookloops_state_as_data(tmp_path):
    counter = Counter()
    loop = make(tmp_path, counter)
    loop.fit(max_steps=3)
    ckpt = tmp_path / "step-00000002"
    names = {p.name for p in ckpt.iterdir()}
    assert names == {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                     "hookloop-rank0.safetensors", "hookloop.safetensors", "hookloop.json"}
    doc = json.loads((ckpt / "hookloop.json").read_text())
    assert doc["format"] == "hookloop-checkpoint" and doc["reason"] == "every_steps"
    assert doc["loop"] == {"epoch": 0, "step_in_epoch": 2, "global_step": 2, "micro_step": 2}
    assert doc["networks"] == {"model": {"model": "model.safetensors", "optimizer": "optimizer.bin",
                                         "scheduler": "scheduler.bin"}}
    assert doc["files"] == {n: (ckpt / n).stat().st_size for n in names - {"hookloop.json"}}
    # plugin state: plain JSON, tensors and arrays in safetensors
    state = doc["plugins"]["counter"]
    assert state["steps"] == 2 and state["pair"] == {"__tuple__": [1, "a"]}
    tensors = load_file(ckpt / "hookloop.safetensors")
    assert torch.equal(tensors[state["total"]["__tensor__"]], torch.full((3,), 2.0))
    # the fit's last position is saved too, and latest names it
    assert (tmp_path / "latest").read_text() == "step-00000003\n"
    assert read_manifest(tmp_path / "step-00000003")["reason"] == "fit_end"


def test_keep_last_keeps_the_newest(tmp_path):
    make(tmp_path, every_steps=1, keep_last=2).fit(max_steps=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004", "step-00000005"]


def test_under_accumulation_every_steps_counts_optimizer_updates(tmp_path):
    reset_accelerate()
    checkpoint = Checkpoint(dir=tmp_path, every_steps=3, every_epoch=False, signals=None)
    loop = tiny_loop([checkpoint], accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(max_steps=3)  # 3 updates = 6 batches; saved once, after the 6th
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003"]
    doc = read_manifest(tmp_path / "step-00000003")
    assert doc["reason"] == "every_steps"
    assert doc["loop"] == {"epoch": 0, "step_in_epoch": 6, "global_step": 3, "micro_step": 6}


def test_epoch_end_checkpoints_resume_after_the_evaluation(tmp_path):
    loop = make(tmp_path, every_steps=None)
    loop.fit(epochs=1)
    doc = read_manifest(tmp_path / "step-00000008-epoch-end")
    assert doc["loop"] == {"epoch": 1, "step_in_epoch": 0, "global_step": 8, "micro_step": 8}


# -- exact resume ------------------------------------------------------------------


@pytest.mark.parametrize(("accum", "stop"), [(1, 5), (1, 8), (1, 12), (2, 3), (2, 7)])
def test_resume_ends_bit_for_bit_where_the_uninterrupted_run_ends(tmp_path, accum, stop):
    """Shuffling, dropout, a warm-up schedule, evaluation (which draws a
    seed; also at the stop, which ends the epoch early), accumulation;
    stopped mid-epoch, at an epoch's last batch (steps count updates: under
    accumulation 2 an epoch of 8 batches is 4)."""
    make(tmp_path, accum=accum).fit(max_steps=stop)
    torch.manual_seed(1234)  # a new process would be elsewhere
    resumed = make(tmp_path, accum=accum, resume_from="latest")
    assert resumed.state.global_step == stop
    assert resumed.state.micro_step == stop * accum
    resumed.fit(epochs=EPOCHS)
    assert differing(params(resumed), reference(accum)) == []


def test_without_restoring_the_epochs_random_state_the_resume_differs(tmp_path, monkeypatch):
    """The comparison above is sharp: the plain skip_first_batches recipe
    redraws the interrupted epoch's shuffle and fails it."""
    from hookloop import checkpointing

    make(tmp_path).fit(max_steps=5)

    def plain_skip(self, accelerator, data, skip, **options):
        self.restore_now(data)
        return accelerator.skip_first_batches(data, skip)

    monkeypatch.setattr(checkpointing.Resume, "batches", plain_skip)
    resumed = make(tmp_path, resume_from="latest")
    resumed.fit(epochs=EPOCHS)
    assert differing(params(resumed), reference(1)) != []


def test_a_second_fit_continues_the_epoch_exactly(tiny_loop):
    loop = tiny_loop(eval_data=True)
    loop.fit(max_steps=5)
    loop.fit(epochs=EPOCHS)
    assert differing(params(loop), reference(1)) == []


# -- plugin state --------------------------------------------------------------------


def test_plugin_state_comes_back_as_it_was_given(tmp_path):
    make(tmp_path, Counter()).fit(max_steps=4)
    counter = Counter()
    make(tmp_path, counter, resume_from="latest")
    state = counter.loaded
    assert state["steps"] == 4 and counter.steps == 4
    assert torch.equal(state["total"], torch.full((3,), 4.0))
    assert state["pair"] == (1, "a")
    assert set(state["table"]) == {3, "x"} and state["table"]["x"] == [1.5, None, True]
    assert isinstance(state["table"][3], np.ndarray) and state["table"][3].tolist() == [0, 1, 2, 3]


def test_plugin_state_that_is_not_data_is_refused_naming_the_plugin(tmp_path):
    class Opaque(Counter):
        name = "opaque"

        def state_dict(self):
            return {"fn": print}

    loop = make(tmp_path, Opaque())
    with pytest.raises(Exception, match=r"plugin 'opaque': state_dict\(\)\['fn'\] is a builtins.builtin_function_or_method"):
        loop.fit(max_steps=2)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_resuming_without_a_stateful_plugin_names_it(tmp_path):
    make(tmp_path, Counter()).fit(max_steps=2)
    with pytest.raises(CheckpointError, match=r"plugin\(s\) 'counter'.*strict=False"):
        make(tmp_path, resume_from="latest")
    loop = make(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"'counter'.*not restored"):
        loop.load_checkpoint("latest", strict=False)
    assert loop.state.global_step == 2


def test_resuming_with_a_new_stateful_plugin_names_it(tmp_path):
    make(tmp_path).fit(max_steps=2)
    with pytest.raises(CheckpointError, match=r"'counter' have state.*has none for them"):
        make(tmp_path, Counter(), resume_from="latest")
    counter = Counter()
    loop = make(tmp_path, counter)
    with pytest.warns(RuntimeWarning, match="'counter'.*start fresh"):
        loop.load_checkpoint("latest", strict=False)
    assert counter.loaded is None and loop.state.global_step == 2


def test_a_mismatch_changes_nothing(tmp_path):
    make(tmp_path, Counter()).fit(max_steps=2)
    loop = make(tmp_path)
    before = params(loop)
    with pytest.raises(CheckpointError):
        loop.load_checkpoint("latest")
    assert differing(params(loop), before) == [] and loop.state.global_step == 0


# -- random states, latest -----------------------------------------------------------


def test_unreadable_random_states_are_an_error_not_an_info_line(tmp_path):
    make(tmp_path).fit(max_steps=2)
    rng = tmp_path / "step-00000002" / "random_states_0.pkl"
    rng.write_bytes(b"\0" * rng.stat().st_size)  # same size: only reading it can tell
    with pytest.raises(CheckpointError, match="cannot read the random states of process 0"):
        make(tmp_path, resume_from="latest")


def test_latest_naming_a_missing_checkpoint_falls_back_to_the_newest_complete_one(tmp_path):
    make(tmp_path).fit(max_steps=4)
    (tmp_path / "latest").write_text("step-00000099\n")
    with pytest.warns(RuntimeWarning, match="step-00000099.*newest usable"):
        loop = make(tmp_path, resume_from="latest")
    assert loop.resumed_from.name == "step-00000004"


def test_latest_with_nothing_saved_starts_from_scratch(tmp_path):
    loop = make(tmp_path / "never", resume_from="latest")
    assert loop.resumed_from is None and loop.state.global_step == 0


def test_resume_from_a_checkpoint_root_uses_its_latest(tmp_path):
    make(tmp_path / "run").fit(max_steps=3)
    reset_accelerate()
    loop = tiny_loop(eval_data=True, resume_from=tmp_path / "run")
    assert loop.resumed_from == tmp_path / "run" / "step-00000003"


def test_gan_strategy_state_is_checkpointed(tmp_path):
    from hookloop import Loop, Network
    from hookloop.strategies import GAN
    from torch.utils.data import DataLoader, TensorDataset

    def gan(resume_from=None):
        reset_accelerate()
        torch.manual_seed(0)
        G, D = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        return Loop(networks={"generator": Network(G, torch.optim.SGD(G.parameters(), lr=0.1)),
                              "discriminator": Network(D, torch.optim.SGD(D.parameters(), lr=0.1))},
                    strategy=GAN(latent_dim=2, n_critic=2), block=["progress"],
                    train_data=DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=8),
                    plugins=[Checkpoint(dir=tmp_path, signals=None)], resume_from=resume_from)

    gan().fit(max_steps=3)
    doc = read_manifest(tmp_path / "step-00000003")
    assert doc["plugins"]["gan"]["d_updates"] == 3
    assert list(doc["networks"]) == ["generator", "discriminator"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = gan(resume_from="latest")
    assert resumed.strategy.d_updates == 3


def test_a_resumed_fit_with_nothing_left_to_do_saves_nothing(tmp_path):
    make(tmp_path).fit(max_steps=4)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    make(tmp_path, resume_from="latest").fit(max_steps=4)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_resuming_from_an_older_checkpoint_warns_about_the_newer_ones(tmp_path):
    make(tmp_path, every_steps=2, keep_last=None).fit(max_steps=6)
    loop = make(tmp_path, resume_from=tmp_path / "step-00000002")
    with pytest.warns(RuntimeWarning, match=r"resumed from step-00000002.*\(step-00000004, step-00000006\)"):
        loop.fit(max_steps=3)


def test_a_save_at_the_resumed_position_names_the_resumed_checkpoint(tmp_path):
    # (found by mypy: the "saved here already" shortcut returned None after a
    # resume, when nothing this run saved held the position)
    make(tmp_path).fit(epochs=EPOCHS)
    loop = make(tmp_path, resume_from="latest")
    resumed = loop.resumed_from
    loop.fit(epochs=EPOCHS)  # the run had ended: no step, no new checkpoint
    checkpoint = loop.plugins.get("checkpoint")
    assert checkpoint.save(loop) == resumed
