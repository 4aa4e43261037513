"""Several named evaluation sets (``eval_data={"val": ..., "test": ...}`` or a
list), as the Hugging Face Trainer takes a dict of ``eval_dataset`` and
Lightning several validation loaders: each set's metrics under its own keys,
the set's name given to the per-batch evaluation hooks, any of them usable
by ``Checkpoint(monitor=...)`` and early stopping, and a set that is not
batches refused at ``Loop(...)``."""

import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.plugins import Checkpoint
from hookloop.testing import HookRecorder

ROOT = Path(__file__).resolve().parents[2]


def data():
    torch.manual_seed(0)
    x, y = torch.randn(96, 4), torch.randint(0, 3, (96,))
    return x, y


def loader(x, y, batch_size=8):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def make_loop(eval_data, plugins=(), **kwargs):
    x, y = data()
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    return Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2),
                train_data=DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True),
                eval_data=eval_data, plugins=list(plugins), accelerator=Accelerator(cpu=True),
                block=["progress"], **kwargs)


def sets():
    x, y = data()
    return {"val": (x[64:80], y[64:80]), "test": (x[80:], y[80:])}


def test_each_set_has_its_metrics_under_its_own_keys_equal_to_evaluating_it_alone():
    named = sets()
    loop = make_loop({name: loader(*xy) for name, xy in named.items()})
    metrics = loop.fit(epochs=2)
    assert set(metrics) == {"eval_val_loss", "eval_val_accuracy", "eval_test_loss", "eval_test_accuracy"}
    for name, xy in named.items():  # the same numbers as an evaluation of that set alone
        alone = loop.evaluate(loader(*xy, batch_size=5))
        assert alone == {"eval_loss": pytest.approx(metrics[f"eval_{name}_loss"], rel=1e-12),
                         "eval_accuracy": metrics[f"eval_{name}_accuracy"]}
    assert loop.evaluate() == metrics  # evaluate() evaluates every set of eval_data


def test_a_list_of_loaders_names_its_sets_by_position():
    named = sets()
    loop = make_loop([loader(*named["val"]), loader(*named["test"])])
    assert set(loop.fit(epochs=1)) == {"eval_0_loss", "eval_0_accuracy", "eval_1_loss", "eval_1_accuracy"}


def test_the_per_batch_hooks_are_told_the_set_and_one_evaluation_spans_every_set():
    recorder = HookRecorder(hooks=["on_eval_start", "eval_step", "after_eval_step", "on_eval_end"])
    loop = make_loop({name: loader(*xy) for name, xy in sets().items()}, plugins=[recorder])
    loop.fit(epochs=1, sanity_check=False)
    calls = [(c.hook, c.kwargs.get("eval_set")) for c in recorder.calls]
    batches = [("eval_step", "val"), ("after_eval_step", "val")] * 2 + [("eval_step", "test"),
                                                                        ("after_eval_step", "test")] * 2
    assert calls == [("on_eval_start", None), *batches, ("on_eval_end", None)]
    assert recorder.calls[-1].kwargs["metrics"].eval_sets == ("val", "test")


def test_the_sanity_check_evaluates_one_batch_of_each_set():
    recorder = HookRecorder(hooks=["eval_step"])
    make_loop({name: loader(*xy) for name, xy in sets().items()}, plugins=[recorder]).fit(max_steps=1)
    assert [c.kwargs["eval_set"] for c in recorder.calls][:2] == ["val", "test"]  # then the epoch's


def test_checkpoint_monitors_one_set_and_keeps_its_best(tmp_path):
    named = sets()
    checkpoint = Checkpoint(dir=tmp_path, monitor="eval_test_loss", every_epoch=True)
    losses = []

    class Record:
        @hookimpl
        def on_epoch_end(self, metrics):
            losses.append(metrics["eval_test_loss"])

    loop = make_loop({name: loader(*xy) for name, xy in named.items()}, plugins=[checkpoint, Record()])
    loop.fit(epochs=4)
    assert checkpoint.best["value"] == pytest.approx(min(losses))


def test_a_misspelt_monitor_of_several_sets_fails_at_the_sanity_check_listing_every_set(tmp_path):
    loop = make_loop({name: loader(*xy) for name, xy in sets().items()},
                     plugins=[Checkpoint(dir=tmp_path, monitor="eval_tets_loss")])
    with pytest.raises(KeyError, match="eval_test_loss.*eval_val_loss|eval_val_loss.*eval_test_loss"):
        loop.fit(epochs=1)
    assert loop.state.global_step == 0


def test_early_stopping_watches_one_set():
    sys.path.insert(0, str(ROOT / "plugins" / "hookloop-early-stopping" / "src"))
    try:
        from hookloop_early_stopping import EarlyStopping
    finally:
        sys.path.pop(0)
    def stop_epoch(losses):  # where patience=1, mode="max" stops: the first epoch without a new high
        return next(i for i in range(1, len(losses)) if losses[i] <= max(losses[:i])) + 1

    seen = []

    class Record:
        @hookimpl
        def on_epoch_end(self, metrics):
            seen.append((metrics["eval_val_loss"], metrics["eval_test_loss"]))

    # mode="max" on a falling loss stops at the first epoch that is not the worst yet
    make_loop({name: loader(*xy) for name, xy in sets().items()}, plugins=[Record()]).fit(epochs=8)
    val, test = zip(*seen)
    assert stop_epoch(val) != stop_epoch(test)  # (the set watched decides)
    loop = make_loop({name: loader(*xy) for name, xy in sets().items()},
                     plugins=[EarlyStopping(monitor="eval_test_loss", mode="max", patience=1)])
    loop.fit(epochs=8)
    assert loop.state.epoch == stop_epoch(test) and "eval_test_loss did not improve" in loop.state.stop_reason


@pytest.mark.parametrize("eval_data, culprit", [
    (lambda dl: {"val": dl, "test": TensorDataset(torch.zeros(2, 4))}, "eval_data['test'] is a torch.utils.data"),
    (lambda dl: [dl, "test.csv"], "eval_data[1] is a builtins.str"),
    (lambda dl: {"val": dl, "test": torch.zeros(8, 4)}, "eval_data['test'] is a torch.Tensor"),
], ids=["a dataset", "a file name", "a tensor"])
def test_a_set_that_is_not_batches_is_refused_at_loop_naming_it(eval_data, culprit):
    x, y = data()
    with pytest.raises(ValueError, match=culprit.replace("[", r"\[").replace("]", r"\]")) as info:
        make_loop(eval_data(loader(x, y)))
    assert "DataLoader" in str(info.value)


def test_a_plugin_writing_an_unnamed_eval_metric_for_several_sets_is_an_error_naming_it():
    class F1:
        """Accumulates over the whole evaluation: its one value would mix the sets."""

        @hookimpl
        def on_eval_end(self, metrics):
            metrics["eval_f1"] = 0.5

    loop = make_loop({name: loader(*xy) for name, xy in sets().items()}, plugins=[F1()])
    with pytest.raises(ValueError, match=r"metrics\['eval_f1'\] \(plugin 'F1'\).*val, test"):
        loop.fit(epochs=1)
