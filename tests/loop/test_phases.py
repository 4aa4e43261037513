"""fit as its phases: why an epoch ended, which hooks ran for it (once), the
safe points, and a fit asked of a run that is already finished."""

import launching
import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.testing import HookRecorder

EPOCH_END = ["on_train_epoch_end", "on_eval_start", "on_eval_end", "on_epoch_end", "on_safe_point"]


class Stream(IterableDataset):
    """A stream without a length: 4 batches of 8 rows."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(32, 8, generator=g)
        self.y = torch.randint(0, 3, (32,), generator=g)

    def __iter__(self):
        for i in range(0, 32, 8):
            yield self.x[i:i + 8], self.y[i:i + 8]


def _stream_loop(plugins, prepare):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    evaluation = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,))), batch_size=8)
    return Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=DataLoader(Stream(), batch_size=None), eval_data=evaluation,
                plugins=plugins, block=["progress"], prepare=prepare,
                accelerator=Accelerator(cpu=True))


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "plain"])
def test_a_stream_ends_each_epoch_once(prepare):
    recorder = HookRecorder(hooks=["on_epoch_start", *EPOCH_END])
    loop = _stream_loop([recorder], prepare)
    loop.fit(max_steps=4)  # the stream's last batch is update 4
    loop.fit(max_steps=8)  # the whole of epoch 1
    epochs = [c["epoch"] for c in recorder.calls_of("on_epoch_end")]
    assert epochs == [0, 1], recorder.names()
    assert recorder.count("on_train_epoch_end") == 2
    assert recorder.count("on_epoch_start") == 2
    # prepared, Accelerate looks one batch ahead and knows update 8 was the epoch's last
    assert (loop.state.epoch, loop.state.global_step) == ((2, 8) if prepare else (1, 8))


def test_fit_on_a_finished_run_warns_trains_nothing_and_returns_its_last_metrics(tiny_loop):
    recorder = HookRecorder()
    loop = tiny_loop([recorder], eval_data=True)
    metrics = loop.fit(epochs=1)
    assert "eval_loss" in metrics
    recorder.clear()
    with pytest.warns(RuntimeWarning, match=r"fit\(epochs=1\) trains nothing: the run is already at "
                                            r"epoch 1, update 8"):
        again = loop.fit(epochs=1)
    assert again == metrics
    assert recorder.names() == ["on_fit_start", "on_fit_end"]  # no epoch, no sanity check


def test_a_run_resumed_where_a_stop_ended_it_stays_stopped(tiny_loop, tmp_path):
    from hookloop.plugins import Checkpoint
    from hookloop.testing import reset_accelerate

    class StopAt3:
        def __init__(self):
            self.armed = True

        @hookimpl
        def after_step(self, loop):
            if self.armed and loop.state.global_step == 3:
                loop.stop("enough at 3")

    first = tiny_loop([StopAt3(), Checkpoint(dir=tmp_path, signals=None)])
    first.fit(epochs=2)
    assert first.state.global_step == 3
    reset_accelerate()
    stopper = StopAt3()
    again = tiny_loop([stopper, Checkpoint(dir=tmp_path, signals=None)], resume_from="latest")
    with pytest.warns(RuntimeWarning, match=r"stopped there \(enough at 3\) and resumed"):
        again.fit(epochs=2)  # the same fit call as the stopped one: it stays stopped
    assert again.state.global_step == 3
    stopper.armed = False
    again.fit(epochs=2)  # a second fit trains on
    assert again.state.global_step == 16


def test_a_stop_asked_in_an_eval_every_evaluation_stops_at_that_update(tiny_loop):
    seen = []

    class StopAt3:
        @hookimpl
        def on_eval_end(self, loop, metrics):
            if loop.state.stage == "sanity":
                return
            seen.append((loop.state.global_step, "on_eval_end", metrics["eval_loss"]))
            if loop.state.global_step == 3:
                loop.stop("enough")

        @hookimpl
        def on_epoch_end(self, loop, metrics):
            seen.append((loop.state.global_step, "on_epoch_end", metrics["eval_loss"]))

        @hookimpl
        def on_safe_point(self, loop):
            seen.append((loop.state.global_step, "on_safe_point", None))

    loop = tiny_loop([StopAt3()], eval_data=True)  # 8 batches an epoch
    metrics = loop.fit(epochs=1, eval_every=1)
    assert loop.state.global_step == 3
    # updates 1 and 2: evaluation, then safe point; update 3's evaluation is the epoch end's
    assert [(step, hook) for step, hook, _ in seen] == [
        (1, "on_eval_end"), (1, "on_safe_point"), (2, "on_eval_end"), (2, "on_safe_point"),
        (3, "on_eval_end"), (3, "on_epoch_end"), (3, "on_safe_point")]
    assert metrics["eval_loss"] == seen[4][2] == seen[5][2]


def test_safe_points_come_after_each_update_and_each_epoch_end(tiny_loop):
    seen = []

    class Watch:
        @hookimpl
        def on_safe_point(self, loop, epoch_end, fit_end):
            s = loop.state
            seen.append((s.global_step, s.epoch, s.step_in_epoch, epoch_end, fit_end, loop.at_safe_point))

        @hookimpl
        def before_step(self, loop):
            assert not loop.at_safe_point
            if loop.state.step_in_epoch == 2:
                loop.skip_batch()  # the third batch of every epoch: no update, no safe point

    loop = tiny_loop([Watch()], accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(epochs=2)  # 8 batches an epoch, one skipped: 4 updates an epoch (the last group of 1)
    assert seen == [
        (1, 0, 2, False, False, True), (2, 0, 5, False, False, True), (3, 0, 7, False, False, True),
        (4, 0, 8, False, False, True), (4, 1, 0, True, False, True),
        (5, 1, 2, False, False, True), (6, 1, 5, False, False, True), (7, 1, 7, False, False, True),
        (8, 1, 8, False, False, True), (8, 2, 0, True, True, True),
    ]
    assert loop.at_safe_point  # outside fit


def test_epoch_values_of_an_epoch_split_over_two_fits_are_the_epoch_s(tiny_loop):
    class Flag:
        @hookimpl
        def after_step(self, loop):
            loop.log({"flag": 1.0 if loop.state.global_step <= 3 else 0.0}, on_step=False, on_epoch=True)

    whole = tiny_loop([Flag()]).fit(epochs=1)
    split = tiny_loop([Flag()])
    early = split.fit(max_steps=4)
    assert early["flag"] == 0.75  # the epoch so far
    assert split.fit(epochs=1)["flag"] == whole["flag"] == 0.375


def test_the_reason_an_epoch_ended_is_named_until_its_safe_point(tiny_loop):
    reasons = []

    class Why:
        @hookimpl
        def on_train_epoch_end(self, loop):
            reasons.append(("train_end", loop.state.epoch_end_reason))

        @hookimpl
        def on_safe_point(self, loop, epoch_end):
            if epoch_end:
                reasons.append(("safe", loop.state.epoch_end_reason))
            elif loop.state.epoch_end_reason is not None:
                reasons.append(("last update", loop.state.epoch_end_reason))

        @hookimpl
        def after_step(self, loop):
            if loop.state.global_step == 10:
                loop.end_epoch()
            if loop.state.global_step == 13:
                loop.stop()

    loop = tiny_loop([Why()])
    loop.fit(max_steps=5)
    loop.fit(max_steps=20)
    assert reasons == [("train_end", "max_steps"), ("safe", "max_steps"), ("last update", "data"),
                       ("train_end", "data"), ("safe", "data"), ("train_end", "end_epoch"),
                       ("safe", "end_epoch"), ("train_end", "stop"), ("safe", "stop")]
    assert loop.state.epoch_end_reason is None
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (2, 3, 13)


def test_fit_to_a_limit_the_resumed_run_has_passed_warns_and_trains_nothing(tiny_loop, tmp_path):
    from hookloop.plugins import Checkpoint
    from hookloop.testing import parameters, reset_accelerate

    tiny_loop([Checkpoint(dir=tmp_path, signals=None)]).fit(max_steps=13)
    reset_accelerate()
    loop = tiny_loop([Checkpoint(dir=tmp_path, signals=None)], resume_from="latest")
    before = parameters(loop)
    with pytest.warns(RuntimeWarning, match=r"fit\(max_steps=10\) trains nothing: the run is already "
                                            r"at epoch 1, update 13, 5 batches into the epoch"):
        loop.fit(max_steps=10)
    assert loop.state.global_step == 13
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(loop)))


# -- processes that disagree ---------------------------------------------------------------


@pytest.mark.slow
def test_a_stop_asked_on_one_process_stops_every_process_at_the_same_update(tmp_path):
    import json


    result = launching.run_two("disagree_two_processes.py", tmp_path, "stop", timeout=120)  # 0.2: hangs forever
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    # asked at update 3 on rank 0 alone: both stop at the next agreement point (every 10 updates)
    assert [r["global_step"] for r in ranks] == [10, 10]
    assert ranks[1]["stop_reason"] == "rank 0 had enough (asked on another process)"


@pytest.mark.slow
def test_metric_values_not_gathered_over_processes_are_refused_on_every_process(tmp_path):
    import json


    launching.run_two("disagree_two_processes.py", tmp_path, "ungathered", timeout=120)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:  # in the sanity check, before any training; 0.2: ranks disagree silently
        assert rank["error"].startswith("ValueError: after_eval_step: plugin 'Ungathered' returned "
                                        "'eval_mine' as this process's 8 values, not the batch's 16")


def test_an_error_from_disagreeing_collectives_says_so(tiny_loop, monkeypatch):
    class Mismatch:
        @hookimpl
        def after_backward(self):
            raise RuntimeError("[enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 196 vs 4. "
                               "Received data size doesn't match expected size. Is there a distributed "
                               "collective mismatch in your code?")

    loop = tiny_loop([Mismatch()])
    monkeypatch.setattr(type(loop.accelerator), "num_processes", property(lambda self: 2))
    with pytest.raises(RuntimeError) as info:
        loop.fit(max_steps=1)
    notes = "\n".join(info.value.__notes__)
    assert "surfaced in hook 'after_backward' of plugin 'Mismatch'" in notes
    assert "may have run different collectives" in notes and "some processes only" in notes


def test_a_discarded_update_changes_nothing_is_not_counted_and_its_batch_is_not_drawn_again(tiny_loop):
    """``commit_update`` returning False (what per-step fault tolerance does when the
    replicas do not agree to commit): the batch is consumed, the optimizer and the
    scheduler do not step, the gradients are zeroed, the update is not counted and
    has no safe point."""
    safe_points, params, lrs = [], [], []

    class Discard:
        @hookimpl
        def commit_update(self, loop, network):
            return loop.state.step_in_epoch != 3  # the third batch's update

        @hookimpl
        def after_step(self, loop):
            net = loop.networks["model"]
            params.append([p.detach().clone() for p in net.unwrapped.parameters()])
            lrs.append(net.optimizer.param_groups[0]["lr"])
            assert all(p.grad is None or not p.grad.any() for p in net.unwrapped.parameters())

        @hookimpl
        def on_safe_point(self, loop, epoch_end):
            if not epoch_end:
                safe_points.append((loop.state.global_step, loop.state.step_in_epoch))

    loop = tiny_loop([Discard()])
    loop.fit(epochs=1)  # 8 batches
    assert (loop.state.global_step, loop.state.micro_step, loop.discarded_updates) == (7, 8, 1)
    assert safe_points == [(1, 1), (2, 2), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8)]
    same = [all(torch.equal(a, b) for a, b in zip(params[i], params[i - 1])) for i in range(1, 8)]
    assert same == [False, True, False, False, False, False, False]  # batch 3 changed nothing
    assert lrs[2] == lrs[1] != lrs[3]  # nor stepped the scheduler
    optimizer = loop.networks["model"].optimizer
    assert {int(s["step"]) for s in optimizer.state_dict()["state"].values()} == {7}  # Adam's own count
