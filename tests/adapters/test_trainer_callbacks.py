"""TrainerCallbacks: Hugging Face TrainerCallbacks, unchanged, on a hookloop Loop.

The proof is against ``transformers.Trainer`` itself: a tiny BERT built from a
config trains on CPU under both, and a recording callback must see the same
(event, global_step, int(epoch)) sequence. About a minute in all on 2 cores
(each Trainer-comparison run takes a second or two, on one thread); the
two-process test is slow-marked.
"""

import json
import subprocess
import sys
from pathlib import Path

import launching
import pytest
import torch

transformers = pytest.importorskip("transformers")

from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    EarlyStoppingCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    get_linear_schedule_with_warmup,
)

from hookloop import Loop  # noqa: E402
from hookloop.adapters.transformers import TrainerCallbacks  # noqa: E402
from hookloop.plugins import BUILTINS, Checkpoint, GradClip, Logger  # noqa: E402
from hookloop.testing import reset_accelerate, tiny_gan_loop, tiny_loop  # noqa: E402
from paths import ROOT, SCRIPTS  # noqa: F401

SCRIPTS = SCRIPTS


@pytest.fixture(autouse=True)
def _one_thread():
    """These matrices are too small to share: two threads on two busy cores
    make a tiny BERT's backward pass 20 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

EVENTS = ["on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end",
          "on_step_end", "on_evaluate", "on_predict", "on_save", "on_log", "on_prediction_step"]


class Recorder(TrainerCallback):
    """Every event as (event, global_step, int(epoch)); the logs and the
    keyword arguments of every event."""

    def __init__(self):
        self.events = []
        self.logs = []
        self.kwargs = {}


def _recording(event):
    def method(self, args, state, control, **kwargs):
        self.events.append((event, state.global_step, int(state.epoch or 0)))
        self.kwargs.setdefault(event, kwargs)
        if event == "on_log":
            self.logs.append(dict(kwargs["logs"]))
    return method


for _event in EVENTS:
    setattr(Recorder, _event, _recording(_event))


class At(TrainerCallback):
    """Set ``control.<flag>`` in ``on_step_end`` at the given updates."""

    def __init__(self, flag, steps):
        self.flag, self.steps = flag, set(steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            setattr(control, self.flag, True)


# -- a tiny BERT, trained by the Trainer and by a Loop --------------------------------


def examples(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n, 8), generator=g)
    labels = (ids[:, 0] > 50).long()
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def bert():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=16, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def training_args(out, **options):
    base = dict(output_dir=str(out), use_cpu=True, report_to=[], num_train_epochs=2,
                per_device_train_batch_size=4, per_device_eval_batch_size=4, disable_tqdm=True,
                seed=0, learning_rate=5e-4, train_sampling_strategy="sequential")
    return TrainingArguments(**{**base, **options})


def accuracy(prediction):
    logits, labels = prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def run_trainer(tmp, callbacks, metrics=False, **options):
    """``Trainer.train()`` on 22 examples (6 batches of 4, the last of 2) and
    10 evaluation examples."""
    trainer = Trainer(model=bert(), args=training_args(tmp / "trainer", **options),
                      train_dataset=examples(22, 0), eval_dataset=examples(10, 1),
                      callbacks=callbacks, compute_metrics=accuracy if metrics else None)
    trainer.train()
    return trainer


def run_loop(tmp, callbacks, loop_eval=True, plugins=(), **options):
    """The same training with a Loop: AdamW, the Trainer's linear schedule,
    its gradient clipping (GradClip, max_norm=1), a Checkpoint plugin for
    should_save. ``loop_eval``: the evaluation set goes to the Loop (evaluated
    at every epoch end), else to the adapter (evaluated when the callbacks ask)."""
    reset_accelerate()
    args = training_args(tmp / "hookloop", **options)
    k = args.gradient_accumulation_steps
    model = bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    train = DataLoader(examples(22, 0), batch_size=4, collate_fn=default_data_collator)
    evaluation = DataLoader(examples(10, 1), batch_size=4, collate_fn=default_data_collator)
    epochs = int(args.num_train_epochs)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, epochs * -(-len(train) // k))
    adapter = TrainerCallbacks(callbacks, args=args, eval_data=None if loop_eval else evaluation)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=train,
                eval_data=evaluation if loop_eval else None,
                plugins=[GradClip(max_norm=1.0),
                         Checkpoint(dir=tmp / "checkpoints", every_epoch=False, keep_last=None,
                                    signals=None),
                         *plugins, adapter],
                accelerator=Accelerator(cpu=True, gradient_accumulation_steps=k))
    loop.fit(epochs=epochs)
    loop.close()
    return loop, adapter


# -- 4. the proof: the same events as Trainer.train() ---------------------------------

CONFIGS = {
    # the evaluation set where each side evaluates exactly when eval_strategy says
    "epoch, accumulation 1": (dict(eval_strategy="epoch", save_strategy="epoch",
                                   logging_strategy="epoch"), True),
    "epoch, accumulation 2": (dict(eval_strategy="epoch", save_strategy="epoch",
                                   logging_strategy="epoch", gradient_accumulation_steps=2), True),
    "steps, accumulation 1": (dict(eval_strategy="steps", eval_steps=3, save_strategy="steps",
                                   save_steps=4, logging_strategy="steps", logging_steps=2,
                                   logging_first_step=True), False),
    "steps, accumulation 2": (dict(eval_strategy="steps", eval_steps=3, save_strategy="steps",
                                   save_steps=4, logging_strategy="steps", logging_steps=2,
                                   gradient_accumulation_steps=2), False),
    # a callback ends the first epoch after 2 of its 6 updates; the second runs whole
    "should_epoch_stop": (dict(eval_strategy="epoch", save_strategy="no", logging_strategy="steps",
                               logging_steps=1), True, lambda: [At("should_epoch_stop", [2])]),
    # a callback stops training at update 2: the epoch still ends (evaluation, save)
    "should_training_stop": (dict(eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch",
                                  gradient_accumulation_steps=2),
                             True, lambda: [At("should_training_stop", [2])]),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_same_events_as_the_trainer(tmp_path, config):
    options, loop_eval, *extra = CONFIGS[config]
    more = extra[0] if extra else list
    by_trainer, by_loop = Recorder(), Recorder()
    run_trainer(tmp_path, [*more(), by_trainer], metrics=True, **options)
    loop, adapter = run_loop(tmp_path, [*more(), by_loop], loop_eval=loop_eval, **options)

    assert by_loop.events == by_trainer.events
    names = {e for e, _, _ in by_loop.events}
    assert {"on_log", "on_evaluate", "on_prediction_step"} <= names
    assert ("on_save" in names) == (options["save_strategy"] != "no")
    assert ("on_substep_end" in names) == (options.get("gradient_accumulation_steps", 1) > 1)
    # what was logged: the same keys, and (without accumulation) the same numbers
    for mine, theirs in zip(by_loop.logs, by_trainer.logs, strict=True):
        assert mine.keys() == theirs.keys()
        for key in ("epoch", "learning_rate", "eval_loss", "eval_accuracy"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], abs=1e-6), key
        if options.get("gradient_accumulation_steps", 1) == 1:
            for key in ("loss", "grad_norm", "train_loss"):
                if key in theirs:
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-4), key
    assert adapter.state.global_step == loop.state.global_step
    assert [e for e in adapter.state.log_history if "eval_loss" in e]
    # every on_save is a hookloop checkpoint
    assert all(Path(p).is_dir() for p in adapter._saves.saved_at.values())


def test_early_stopping_stops_at_the_same_step_as_the_trainer(tmp_path):
    """EarlyStoppingCallback reads state.best_metric, which the Trainer (and
    the adapter) update after each evaluation: here the evaluation loss
    falls for 6 evaluations, then rises twice (the learning rate is high):
    stopped at update 16 of 48."""
    options = dict(eval_strategy="steps", eval_steps=2, save_strategy="no", logging_strategy="no",
                   num_train_epochs=8, learning_rate=1e-2, metric_for_best_model="eval_loss")

    def stopper():
        return EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=1e-3)

    trainer_stop, loop_stop = stopper(), stopper()
    trainer = run_trainer(tmp_path, [trainer_stop], **options)
    loop, adapter = run_loop(tmp_path, [loop_stop], loop_eval=False, **options)
    stopped = trainer.state.global_step
    assert stopped == 16 and trainer.state.max_steps == adapter.state.max_steps == 48
    assert loop.state.global_step == adapter.state.global_step == stopped
    assert loop.state.stop_reason == "a Trainer callback set control.should_training_stop"
    # the same numbers, up to float rounding that a high learning rate amplifies
    assert adapter.state.best_metric == pytest.approx(trainer.state.best_metric, rel=1e-3)
    history = [(e["step"], e["eval_loss"]) for e in adapter.state.log_history if "eval_loss" in e]
    theirs = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert [s for s, _ in history] == [s for s, _ in theirs] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [v for _, v in history] == pytest.approx([v for _, v in theirs], rel=1e-3)
    assert loop_stop.early_stopping_patience_counter == trainer_stop.early_stopping_patience_counter == 2


def _scalars(root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(Path(root).rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_the_trainer_s_scalar_tags(tmp_path, monkeypatch):
    from transformers.integrations import TensorBoardCallback

    options = dict(eval_strategy="epoch", save_strategy="no", logging_strategy="steps", logging_steps=2)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb-trainer"))
    run_trainer(tmp_path, [TensorBoardCallback()], metrics=True, **options)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb-hookloop"))
    run_loop(tmp_path, [TensorBoardCallback()], **options)

    theirs, mine = _scalars(tmp_path / "tb-trainer"), _scalars(tmp_path / "tb-hookloop")
    assert sorted(mine) == sorted(theirs)
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "train/epoch", "eval/loss",
            "eval/accuracy", "eval/runtime", "train/train_loss", "train/total_flos"} <= set(mine)
    for tag in ("train/loss", "train/learning_rate", "eval/loss", "train/epoch", "train/total_flos"):
        assert [s for s, _ in mine[tag]] == [s for s, _ in theirs[tag]], tag
        assert [v for _, v in mine[tag]] == pytest.approx([v for _, v in theirs[tag]], rel=1e-4), tag


# -- 1. events and their keyword arguments --------------------------------------------------


def test_events_carry_the_trainer_s_keyword_arguments(tmp_path):
    recorder = Recorder()
    tokenizer = object()
    loop = tiny_loop([TrainerCallbacks([recorder], processing_class=tokenizer)], eval_data=True)
    loop.fit(epochs=1)
    network = loop.networks["model"]
    for event in ("on_init_end", "on_train_begin", "on_step_begin", "on_pre_optimizer_step",
                  "on_optimizer_step", "on_step_end", "on_evaluate", "on_log", "on_epoch_end",
                  "on_train_end"):
        kwargs = recorder.kwargs[event]
        assert kwargs["model"] is network.unwrapped, event
        assert kwargs["optimizer"] is network.optimizer and kwargs["lr_scheduler"] is network.scheduler
        assert kwargs["processing_class"] is tokenizer
        assert kwargs["train_dataloader"] is loop.train_data
    assert recorder.kwargs["on_evaluate"]["eval_dataloader"] is loop.eval_data
    assert set(recorder.kwargs["on_evaluate"]["metrics"]) >= {"eval_loss", "eval_accuracy", "eval_runtime",
                                                              "eval_samples_per_second", "epoch"}
    assert "logs" in recorder.kwargs["on_log"]
    # the default arguments: evaluate every epoch (the loop has eval_data), save nothing,
    # log every 50 updates (no Logger): 8 updates, so only the summary and the evaluation
    assert [set(logs) & {"loss", "eval_loss", "train_loss"} for logs in recorder.logs] == [
        {"eval_loss"}, {"train_loss"}]
    assert not any(e == "on_save" for e, _, _ in recorder.events)


def test_several_networks_each_update_is_an_optimizer_event_with_its_objects():
    recorder = Recorder()

    class Objects(TrainerCallback):
        seen = []

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.seen.append((model, optimizer))

    loop = tiny_gan_loop([Logger(every=2, console=False), TrainerCallbacks([recorder, Objects()])])
    loop.fit(epochs=1)
    g, d = loop.networks["generator"], loop.networks["discriminator"]
    assert loop.state.global_step == 4
    assert [e for e, _, _ in recorder.events].count("on_optimizer_step") == 8  # 2 networks x 4
    assert set(Objects.seen) == {(g.unwrapped, g.optimizer), (d.unwrapped, d.optimizer)}
    assert recorder.kwargs["on_step_end"]["model"] is g.unwrapped  # the first network
    losses = [logs for logs in recorder.logs if "loss/generator" in logs]
    assert len(losses) == 2 and {"loss/discriminator", "learning_rate/generator",
                                 "learning_rate/discriminator"} <= set(losses[0])


# -- 2. the TrainerState -----------------------------------------------------------------


def test_the_trainer_state_is_true_under_accumulation():
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((state.global_step, state.epoch, state.max_steps, state.num_train_epochs,
                         state.train_batch_size, state.is_world_process_zero,
                         state.is_local_process_zero))

    # 64 examples in batches of 8: 8 batches an epoch, 3 updates of 3 (the last of 2)
    loop = tiny_loop([TrainerCallbacks([Watch()])],
                     accelerator=Accelerator(cpu=True, gradient_accumulation_steps=3))
    loop.fit(epochs=2)
    assert [s[0] for s in seen] == [1, 2, 3, 4, 5, 6] == list(range(1, loop.state.global_step + 1))
    assert [s[1] for s in seen] == pytest.approx([3 / 8, 6 / 8, 1, 1 + 3 / 8, 1 + 6 / 8, 2])
    assert {s[2:] for s in seen} == {(6, 2, 8, True, True)}


def test_the_state_and_stateful_callbacks_survive_a_resume(tmp_path):
    """EarlyStoppingCallback is an ExportableState: its patience counter, and
    the whole TrainerState, go into hookloop checkpoints and come back."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                             eval_strategy="epoch", metric_for_best_model="eval_accuracy",
                             logging_strategy="epoch")

    def loop_with(stopper, **kwargs):
        reset_accelerate()
        return tiny_loop([Checkpoint(dir=tmp_path / "ck", signals=None),
                          TrainerCallbacks([stopper], args=args)], eval_data=True, **kwargs)

    first = EarlyStoppingCallback(early_stopping_patience=10)
    loop = loop_with(first)
    loop.fit(epochs=2)
    first.early_stopping_patience_counter = 7  # as if 7 evaluations had not improved
    saved = loop.plugins.get("trainer-callbacks")
    loop.fit(epochs=3)  # saves at the end of epoch 3
    state = saved.state
    loop.close()

    again = EarlyStoppingCallback(early_stopping_patience=10)
    resumed = loop_with(again, resume_from="latest")
    adapter = resumed.plugins.get("trainer-callbacks")
    restored = adapter.state
    assert again.early_stopping_patience_counter == first.early_stopping_patience_counter
    assert (restored.global_step, restored.epoch, restored.best_metric) == (
        state.global_step, state.epoch, state.best_metric)
    # saved at the end of epoch 3, before the fit's closing summary log: a training and
    # an evaluation log per epoch, and the first fit's summary
    assert restored.log_history == state.log_history[:-1] and len(restored.log_history) == 3 * 2 + 1
    assert restored.stateful_callbacks["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 8}
    resumed.fit(epochs=4)
    assert adapter.state.global_step == 4 * 8 and len(adapter.state.log_history) == 4 * 2 + 2
    assert again.early_stopping_patience_counter in (0, 9)  # improved, or once more not


# -- 3. TrainerControl obeyed ---------------------------------------------------------------


def test_should_training_stop_stops_the_loop_and_the_epoch_still_ends():
    recorder = Recorder()
    loop = tiny_loop([TrainerCallbacks([At("should_training_stop", [3]), recorder])], eval_data=True)
    metrics = loop.fit(epochs=2)
    assert loop.state.global_step == 3 and "eval_loss" in metrics
    # the epoch ends as the Trainer's does: its evaluation (2 batches), then the summary
    assert recorder.events[-8:] == [(e, 3, 0) for e in (
        "on_step_end", "on_epoch_end", "on_prediction_step", "on_prediction_step", "on_log",
        "on_evaluate", "on_log", "on_train_end")]


def test_should_epoch_stop_ends_the_epoch_and_training_goes_on():
    recorder = Recorder()
    loop = tiny_loop([TrainerCallbacks([At("should_epoch_stop", [2]), recorder])])
    loop.fit(epochs=2)
    # epoch 0: 2 updates, then its other 6 batches skipped; epoch 1: all 8
    assert loop.state.global_step == 2 + 8 and loop.state.micro_step == 10
    assert loop.state.epoch == 2
    begins = [(step, epoch) for e, step, epoch in recorder.events if e == "on_epoch_begin"]
    ends = [(step, epoch) for e, step, epoch in recorder.events if e == "on_epoch_end"]
    assert begins == [(0, 0), (2, 0)] and ends == [(2, 0), (10, 2)]


def test_should_evaluate_evaluates_now_and_should_log_logs_now(tmp_path):
    recorder = Recorder()
    loop = tiny_loop([TrainerCallbacks([At("should_evaluate", [2]), At("should_log", [3]), recorder])],
                     eval_data=True)
    loop.fit(epochs=1)
    evaluations = [step for e, step, _ in recorder.events if e == "on_evaluate"]
    assert evaluations == [2, 8]  # asked for at update 2, and the loop's own at the epoch end
    logged = [logs for logs in recorder.logs if "loss" in logs]
    assert len(logged) == 1 and logged[0]["epoch"] == pytest.approx(3 / 8)
    assert logged[0]["loss"] > 0 and "learning_rate" in logged[0]


def test_should_save_writes_a_checkpoint_and_names_the_best(tmp_path):
    recorder = Recorder()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                             eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                             metric_for_best_model="eval_loss", logging_strategy="no")
    adapter = TrainerCallbacks([recorder], args=args)
    loop = tiny_loop([Checkpoint(dir=tmp_path / "ck", every_epoch=False, signals=None, keep_last=None),
                      adapter], eval_data=True)
    loop.fit(epochs=1)
    saves = [step for e, step, _ in recorder.events if e == "on_save"]
    assert saves == [2, 4, 6, 8]
    # update 8's checkpoint comes before its epoch's end, as the Trainer's does; the
    # fit's own last checkpoint (after the epoch end) is not an on_save
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == [
        "step-00000002", "step-00000004", "step-00000006", "step-00000008",
        "step-00000008-epoch-end"]
    losses = {e["step"]: e["eval_loss"] for e in adapter.state.log_history if "eval_loss" in e and e["step"] % 2 == 0}
    best = min(losses, key=lambda s: losses[s])
    assert adapter.state.best_metric == losses[best]
    assert adapter.state.best_model_checkpoint == str(tmp_path / "ck" / f"step-{best:08d}")


def test_load_best_model_at_end_loads_the_best_checkpoint_s_weights(tmp_path):
    from safetensors.torch import load_file

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                             eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True,
                             metric_for_best_model="accuracy", logging_strategy="no")
    adapter = TrainerCallbacks([], args=args)
    loop = tiny_loop([Checkpoint(dir=tmp_path / "ck", every_epoch=False, signals=None, keep_last=None),
                      adapter], eval_data=True, scheduler=False)
    loop.fit(epochs=4)
    # accuracy 0.375, 0.3125, 0.375, 0.375: the first is the best (strictly greater, as the Trainer)
    accuracies = [e["eval_accuracy"] for e in adapter.state.log_history if "eval_accuracy" in e]
    assert accuracies == [0.375, 0.3125, 0.375, 0.375] and adapter.state.best_metric == 0.375
    best = Path(adapter.state.best_model_checkpoint)
    assert best == tmp_path / "ck" / "step-00000008-epoch-end"
    model = loop.networks["model"].unwrapped
    weights = load_file(str(best / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    last = load_file(str(tmp_path / "ck" / "step-00000032-epoch-end" / "model.safetensors"))
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in last.items())


def test_every_evaluation_and_checkpoint_of_the_loop_is_reported(tmp_path):
    """eval_every evaluations and a Checkpoint plugin's own saves are an
    on_evaluate / on_save each, whatever the TrainingArguments say."""
    recorder = Recorder()
    loop = tiny_loop([Checkpoint(dir=tmp_path, every_steps=3, signals=None, keep_last=None),
                      TrainerCallbacks([recorder])], eval_data=True)
    loop.fit(epochs=1, eval_every=3)
    assert [s for e, s, _ in recorder.events if e == "on_evaluate"] == [3, 6, 8]
    assert [s for e, s, _ in recorder.events if e == "on_save"] == [3, 6, 8]
    # outside a fit too: loop.evaluate()
    loop.evaluate()
    assert recorder.events[-2:] == [("on_log", 8, 1), ("on_evaluate", 8, 1)]


def test_a_best_k_checkpoint_plugin_names_the_best_model(tmp_path):
    """Checkpoint(monitor=...) saves at every epoch end, for save_strategy="epoch" too
    (once), and its ``best`` is the state's best model, loaded at the end."""
    from safetensors.torch import load_file

    recorder = Recorder()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                             eval_strategy="epoch", save_strategy="epoch", logging_strategy="no",
                             metric_for_best_model="loss", load_best_model_at_end=True)
    checkpoint = Checkpoint(dir=tmp_path / "ck", monitor="eval_loss", save_top_k=1, signals=None)
    adapter = TrainerCallbacks([recorder], args=args)
    loop = tiny_loop([checkpoint, adapter], eval_data=True)
    loop.fit(epochs=3)
    assert [s for e, s, _ in recorder.events if e == "on_save"] == [8, 16, 24]
    assert adapter.state.best_model_checkpoint == str(checkpoint.best["path"])
    losses = [e["eval_loss"] for e in adapter.state.log_history if "eval_loss" in e]
    assert adapter.state.best_metric == min(losses) == pytest.approx(checkpoint.best["value"])
    weights = load_file(str(Path(checkpoint.best["path"]) / "model.safetensors"))
    model = loop.networks["model"].unwrapped
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_should_save_never_rotates_away_a_best_checkpoint(tmp_path):
    """save_strategy="steps" saves for the callbacks after a best-k Checkpoint's
    best: it survives them. (The best is made the first epoch's by ranking the
    falling evaluation loss with mode="max".)"""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, logging_strategy="no",
                             save_strategy="steps", save_steps=3)
    checkpoint = Checkpoint(dir=tmp_path / "ck", monitor="eval_loss", mode="max", save_top_k=1,
                            signals=None)
    loop = tiny_loop([checkpoint, TrainerCallbacks([], args=args)], eval_data=True, scheduler=False)
    loop.fit(epochs=4)
    assert Path(checkpoint.best["path"]).name == "step-00000008-epoch-end"
    assert (tmp_path / "ck" / "step-00000008-epoch-end").is_dir()


def test_should_save_without_a_checkpoint_plugin_warns_once():
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, save_strategy="steps",
                             save_steps=2, logging_strategy="no")
    loop = tiny_loop([TrainerCallbacks([], args=args)])
    with pytest.warns(RuntimeWarning, match="no hookloop.plugins.Checkpoint plugin") as caught:
        loop.fit(epochs=1)
    assert sum("Checkpoint plugin" in str(w.message) for w in caught) == 1


def test_training_arguments_made_under_a_live_accelerator_are_named_as_the_culprit(tmp_path):
    loop = tiny_loop([TrainerCallbacks([])], accelerator=Accelerator(cpu=True))
    TrainingArguments(output_dir=str(tmp_path), report_to=[])  # resets Accelerate's state
    with pytest.raises(RuntimeError, match="creating transformers.TrainingArguments does that"):
        loop.fit(epochs=1)


def test_predict_fires_on_predict():
    recorder = Recorder()
    adapter = TrainerCallbacks([recorder])
    loop = tiny_loop([adapter], eval_data=True)
    outputs = adapter.predict(loop, loop.eval_data)
    assert outputs.shape == (16, 3)
    metrics = recorder.kwargs["on_predict"]["metrics"]
    assert {"test_runtime", "test_samples_per_second"} <= set(metrics)


# -- the plugin itself ------------------------------------------------------------------


def test_a_bad_callback_or_args_is_refused_with_its_name():
    with pytest.raises(TypeError, match="is not a transformers.TrainerCallback"):
        TrainerCallbacks([GradClip(max_norm=1.0)])
    with pytest.raises(TypeError, match="must be a transformers.TrainingArguments"):
        TrainerCallbacks([], args={"output_dir": "x"})
    # classes are instantiated, as Trainer(callbacks=[...]) does
    adapter = TrainerCallbacks([EarlyStoppingCallback])
    assert [type(c).__name__ for c in adapter.callbacks] == ["DefaultFlowCallback", "EarlyStoppingCallback"]


def test_report_to_adds_its_integration_callbacks(tmp_path):
    from transformers.integrations import TensorBoardCallback

    args = TrainingArguments(output_dir=str(tmp_path), report_to=["tensorboard"])
    adapter = TrainerCallbacks([Recorder], args=args)
    assert [type(c) for c in adapter.callbacks][1:] == [TensorBoardCallback, Recorder]


def test_listed_by_hookloop_plugins_and_import_hookloop_stays_free_of_transformers(capsys):
    from hookloop.cli import main

    assert BUILTINS["trainer-callbacks"] is TrainerCallbacks
    main(["plugins", "--json"])
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["trainer-callbacks"]
    assert row["changes_training"] is True and "after_step" in row["hooks"]
    code = "import sys, hookloop, hookloop.plugins, hookloop.cli; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_gan_demo_runs_a_trainer_callback(tmp_path, monkeypatch):
    """A Trainer callback on a loop the Trainer could not run: the GAN demo
    (two networks) with TensorBoardCallback."""
    from transformers.integrations import TensorBoardCallback

    from hookloop.examples import gan_digits

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # read when created
    tensorboard = TensorBoardCallback()

    def loop_with_callbacks(*args, plugins=(), **kwargs):
        return Loop(*args, plugins=[*plugins, TrainerCallbacks([tensorboard])], **kwargs)

    monkeypatch.setattr(gan_digits, "Loop", loop_with_callbacks)
    out = tmp_path / "run"
    assert gan_digits.main(["--epochs", "1", "--hidden", "32", "--samples", "100", "--quality-every", "1",
                            "--log-every", "7", "--no-progress", "--out", str(out)]) == 0
    scalars = _scalars(tmp_path / "tb")
    # 28 updates, logged every 7 (the demo's Logger(every=7) sets logging_steps)
    assert [s for s, _ in scalars["train/loss/generator"]] == [7, 14, 21, 28]
    assert {"train/loss/discriminator", "train/learning_rate/generator", "train/grad_norm/generator",
            "train/grad_norm/discriminator", "train/epoch", "train/train_loss/generator"} <= set(scalars)
    assert json.loads((out / "quality.json").read_text())["steps"] == 28


# -- two processes ------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_one_world_process_zero_and_one_tensorboard_writer(tmp_path):
    result = launching.run_two("trainer_callbacks_two_processes.py", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["is_world_process_zero"] for r in ranks] == [True, False]
    assert [r["is_local_process_zero"] for r in ranks] == [True, False]
    # 64 examples, batch 8, two ranks: 4 updates an epoch each; logged every 2
    assert [r["global_step"] for r in ranks] == [8, 8] and ranks[0]["max_steps"] == 8
    # every rank gets every on_log (as under the Trainer), with the same loss averaged over both
    assert ranks[0]["logs"] == ranks[1]["logs"]
    assert [log["step"] for log in ranks[0]["logs"] if "loss" in log] == [2, 4, 6, 8]
    # but one process writes: one event file, each step once
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6, 8]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(
        [log["loss"] for log in ranks[0]["logs"] if "loss" in log])
    assert len(scalars["eval/loss"]) == 2
