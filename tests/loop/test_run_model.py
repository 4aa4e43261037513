"""The 0.2 run model: steps are updates, a stop ends the epoch, evaluation
when asked and on what is asked, exceptions keep their type, accumulation
read when fit starts."""

import json
import math

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.plugins import Logger
from hookloop.testing import HookRecorder, parameters
from hookloop.trackers import JSONLinesTracker


def test_max_steps_1_under_accumulation_2_makes_one_update(tiny_loop):
    loop = tiny_loop(accelerator=Accelerator(gradient_accumulation_steps=2))
    before = parameters(loop)
    loop.fit(max_steps=1)
    assert (loop.state.global_step, loop.state.micro_step, loop.state.step_in_epoch) == (1, 2, 2)
    assert any(not torch.equal(a, b) for a, b in zip(before, parameters(loop)))


def test_logger_every_counts_updates(tiny_loop, tmp_path):
    logger = Logger(every=2, console=False)
    loop = tiny_loop([logger], accelerator=Accelerator(
        gradient_accumulation_steps=4, log_with=[JSONLinesTracker("run", tmp_path)]))
    loop.fit(epochs=2)  # 8 batches an epoch: 2 updates an epoch
    steps = [json.loads(line).get("step") for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [s for s in steps if s is not None] == [2, 4]
    assert loop.state.global_step == 4 and loop.state.micro_step == 16


def test_global_step_in_each_hook_is_as_documented(tiny_loop):
    seen = []

    class Look:
        @hookimpl
        def before_step(self, loop):
            seen.append(("before_step", loop.state.global_step, loop.state.micro_step))

        @hookimpl
        def after_optimizer_step(self, loop):
            seen.append(("after_optimizer_step", loop.state.global_step, loop.state.micro_step))

        @hookimpl
        def after_step(self, loop):
            seen.append(("after_step", loop.state.global_step, loop.state.micro_step))

    tiny_loop([Look()], accelerator=Accelerator(gradient_accumulation_steps=2)).fit(max_steps=1)
    assert seen == [
        ("before_step", 0, 0), ("after_step", 0, 1),
        ("before_step", 0, 1), ("after_optimizer_step", 0, 1), ("after_step", 1, 2),
    ]


# -- a stop ends the epoch the way the end of data does -------------------------------


def test_max_steps_mid_epoch_evaluates_at_the_epoch_end_and_at_the_stop(tiny_loop):
    recorder = HookRecorder(hooks=["on_train_epoch_end", "on_eval_end", "on_epoch_end"])
    steps_at_eval = []

    class At:
        @hookimpl
        def on_eval_start(self, loop):
            steps_at_eval.append(loop.state.global_step)

    loop = tiny_loop([recorder, At()], eval_data=True)  # 8 batches an epoch
    metrics = loop.fit(max_steps=12)
    assert steps_at_eval == [0, 8, 12]  # the sanity check, the epoch end, the stop
    assert recorder.names() == ["on_eval_end", *["on_train_epoch_end", "on_eval_end", "on_epoch_end"] * 2]
    assert [c["epoch"] for c in recorder.calls_of("on_epoch_end")] == [0, 1]
    assert metrics == recorder.calls_of("on_epoch_end")[-1]["metrics"] != {}  # the stop's evaluation
    assert (loop.state.epoch, loop.state.step_in_epoch) == (1, 4)  # still mid-epoch


def test_a_stop_from_after_step_ends_the_epoch_and_the_next_fit_continues_it(tiny_loop):
    complete = []

    class StopAt3:
        @hookimpl
        def after_step(self, loop):
            if loop.state.global_step == 3:
                loop.stop("test")

        @hookimpl
        def on_epoch_end(self, loop, epoch):
            complete.append((epoch, loop.state.epoch_complete))

    loop = tiny_loop([StopAt3()], eval_data=True)
    assert loop.fit(epochs=2) != {}
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (0, 3, 3)
    loop.fit(epochs=1)
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (1, 0, 8)
    assert complete == [(0, False), (0, True)]


def test_a_stop_waits_for_the_end_of_the_accumulation_group(tiny_loop):
    class StopAtBatch3:
        @hookimpl
        def after_step(self, loop):
            if loop.state.micro_step == 3:
                loop.stop()

    loop = tiny_loop([StopAtBatch3()], accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(epochs=1)
    assert (loop.state.global_step, loop.state.micro_step) == (2, 4)


def test_on_train_epoch_end_runs_between_the_last_batch_and_the_evaluation(tiny_loop):
    recorder = HookRecorder(hooks=["after_step", "on_train_epoch_end", "on_eval_start", "on_epoch_end"])
    tiny_loop([recorder], n=16, eval_data=True).fit(epochs=1, sanity_check=False)
    assert recorder.names() == ["after_step", "after_step", "on_train_epoch_end", "on_eval_start",
                                "on_epoch_end"]


# -- evaluation when asked, on what is asked --------------------------------------------


def test_eval_every_evaluates_every_n_updates_without_the_epoch_hooks(tiny_loop):
    at = []

    class At:
        @hookimpl
        def on_eval_end(self, loop):
            if loop.state.stage == "eval":  # not the sanity check
                at.append((loop.state.global_step, loop.state.step_in_epoch))

    recorder = HookRecorder(hooks=["on_epoch_end"])
    loop = tiny_loop([At(), recorder], eval_data=True)
    loop.fit(epochs=2, eval_every=3)
    # 3 and 6 mid-epoch; 8 and 16 at the epoch ends; 9 and 12 (and 15) mid-epoch; no
    # second evaluation where an eval_every step is an epoch's last
    assert at == [(3, 3), (6, 6), (8, 8), (9, 1), (12, 4), (15, 7), (16, 8)]
    assert [c["epoch"] for c in recorder.calls_of("on_epoch_end")] == [0, 1]


def test_eval_every_counts_updates_and_changes_nothing_in_training(tiny_loop):
    plain = tiny_loop(eval_data=True, accelerator=Accelerator(gradient_accumulation_steps=2))
    plain.fit(epochs=2)
    at = []

    class At:
        @hookimpl
        def on_eval_start(self, loop):
            at.append((loop.state.global_step, loop.state.micro_step))

    evaluated = tiny_loop([At()], eval_data=True, accelerator=Accelerator(gradient_accumulation_steps=2))
    evaluated.fit(epochs=2, eval_every=3)
    assert at == [(0, 0), (3, 6), (4, 8), (6, 12), (8, 16)]  # (0, 0): the sanity check
    assert all(torch.equal(a, b) for a, b in zip(parameters(plain), parameters(evaluated)))


def test_evaluate_takes_any_dataloader_and_prepares_it(tiny_loop):
    loop = tiny_loop(eval_data=True)
    x, y = torch.randn(10, 8), torch.randint(0, 3, (10,))
    metrics = loop.evaluate(DataLoader(TensorDataset(x, y), batch_size=4))
    model = loop.networks["model"].unwrapped
    assert model.training and loop.state.stage is None  # train mode and stage restored
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert metrics["eval_loss"] == pytest.approx(
        torch.nn.functional.cross_entropy(logits, y).item(), abs=1e-6)
    assert metrics["eval_accuracy"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())


def test_predict_returns_every_output_in_data_order_and_restores_the_mode(tiny_loop):
    loop = tiny_loop()
    model = loop.networks["model"].unwrapped
    x = torch.randn(11, 8)
    out = loop.predict(DataLoader(TensorDataset(x), batch_size=4))
    assert model.training  # train mode restored
    model.eval()
    with torch.no_grad():
        expected = model(x)
    assert out.shape == (11, 3) and not out.requires_grad
    assert torch.allclose(out, expected, atol=1e-6)


def test_predict_keeps_a_hugging_face_output_s_structure():
    from transformers import BertConfig, BertForSequenceClassification

    from hookloop.testing import reset_accelerate

    reset_accelerate()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    rows = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.tensor(i % 2)} for i in range(10)]
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=DataLoader(rows, batch_size=4), block=["progress"])
    out = loop.predict(DataLoader(rows, batch_size=4))
    assert type(out).__name__ == "SequenceClassifierOutput"
    assert out.logits.shape == (10, 2) and out.loss.shape == (3,)  # one loss per batch


def test_a_causal_language_model_given_labels_evaluates_out_of_the_box():
    from transformers import GPT2Config, GPT2LMHeadModel

    from hookloop.testing import reset_accelerate

    reset_accelerate()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (12, 24))
    rows = [{"input_ids": ids[i], "labels": ids[i]} for i in range(12)]
    data = DataLoader(rows, batch_size=4)
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=data, eval_data=data, block=["progress"])
    metrics = loop.fit(epochs=1)
    model.eval()
    with torch.no_grad():
        expected = sum(model(input_ids=ids[i:i + 4], labels=ids[i:i + 4]).loss.item() for i in (0, 4, 8)) / 3
    assert set(metrics) == {"eval_loss", "perplexity"}
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)  # run_clm_no_trainer's


def test_the_sanity_check_fails_a_wrong_eval_set_before_any_training(tiny_loop):
    recorder = HookRecorder(hooks=["training_step"])
    loop = tiny_loop([recorder])
    loop.eval_data = DataLoader(TensorDataset(torch.randn(8, 5), torch.zeros(8, dtype=torch.long)), batch_size=4)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        loop.fit(epochs=1)
    assert recorder.names() == []  # before the first training step
    assert "raised in hook 'eval_step' of plugin 'supervised'" in info.value.__notes__[0]
    # switched off, the same mistake is found at the end of the epoch
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        loop.fit(epochs=1, sanity_check=False)
    assert recorder.names() == ["training_step"] * 8


def test_the_sanity_check_is_a_whole_evaluation_of_one_batch_and_changes_nothing(tiny_loop):
    plain = tiny_loop(eval_data=True)
    plain.fit(epochs=1, sanity_check=False)
    stages = []

    class Stage:
        @hookimpl
        def on_eval_start(self, loop):
            stages.append(loop.state.stage)

    recorder = HookRecorder(hooks=["on_eval_start", "eval_step", "after_eval_step", "on_eval_end",
                                   "on_epoch_start"])
    checked = tiny_loop([recorder, Stage()], eval_data=True)
    checked.fit(epochs=1)
    assert recorder.names()[:5] == ["on_eval_start", "eval_step", "after_eval_step", "on_eval_end",
                                    "on_epoch_start"]
    assert stages == ["sanity", "eval"]
    assert all(torch.equal(a, b) for a, b in zip(parameters(plain), parameters(checked)))


def test_after_eval_step_returning_a_list_is_named(tiny_loop):
    class Wrong:
        @hookimpl
        def after_eval_step(self):
            return [0.5]

    with pytest.raises(TypeError, match=r"after_eval_step must return None or a dict .* got list"):
        tiny_loop([Wrong()], eval_data=True).fit(epochs=1)


# -- exceptions keep their type ---------------------------------------------------------


def test_an_out_of_memory_error_reaches_the_caller_as_itself(tiny_loop):
    class OOM:
        @hookimpl
        def after_backward(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError) as info:
        tiny_loop([OOM()]).fit(epochs=1)
    assert info.value.__notes__ == ["hookloop: raised in hook 'after_backward' of plugin 'OOM' (code, plugins[0])"]


def test_find_executable_batch_size_retries_a_fit_that_ran_out_of_memory():
    from accelerate.utils import find_executable_batch_size

    from hookloop.testing import tiny_loop

    tried = []

    class OOMAbove:
        def __init__(self, limit):
            self.limit = limit

        @hookimpl
        def before_step(self, batch):
            if len(batch[0]) > self.limit:
                raise torch.OutOfMemoryError("CUDA out of memory.")

    @find_executable_batch_size(starting_batch_size=32)
    def train(batch_size):
        tried.append(batch_size)
        tiny_loop([OOMAbove(8)], batch_size=batch_size).fit(epochs=1)

    train()
    assert tried[0] == 32 and tried[-1] <= 8 < tried[-2]  # retried smaller until it fit


# -- accumulation read when fit starts ------------------------------------------------------


def test_accumulation_set_in_on_fit_start_is_the_same_run_as_from_the_start(tiny_loop):
    class Accumulate:
        @hookimpl
        def on_fit_start(self, loop):
            loop.accelerator.gradient_accumulation_steps = 2

    from_start = tiny_loop(accelerator=Accelerator(gradient_accumulation_steps=2))
    from_start.fit(epochs=2)
    late = tiny_loop([Accumulate()])
    late.fit(epochs=2)
    assert late.state.global_step == from_start.state.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(parameters(from_start), parameters(late)))


def test_accumulation_changed_at_an_epoch_start_takes_effect_exactly_there(tiny_loop):
    class Schedule:  # Lightning's GradientAccumulationScheduler({1: 4})
        @hookimpl
        def on_epoch_start(self, loop, epoch):
            loop.accelerator.gradient_accumulation_steps = 4 if epoch >= 1 else 2

    updates = []

    class Count:
        @hookimpl
        def after_optimizer_step(self, loop):
            updates.append(loop.state.micro_step + 1)  # the batch being trained

    loop = tiny_loop([Schedule(), Count()], accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(epochs=2)
    assert updates == [2, 4, 6, 8, 12, 16]  # groups of 2, then of 4 batches


def test_accumulation_changed_inside_a_group_is_refused(tiny_loop):
    class Meddle:
        @hookimpl
        def after_step(self, loop):
            if loop.state.micro_step == 3:
                loop.accelerator.gradient_accumulation_steps = 4

    loop = tiny_loop([Meddle()], accelerator=Accelerator(gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps changed from 2 to 4 1 batch\(es\) "
                                         r"into an accumulation group"):
        loop.fit(epochs=1)


# -- several loops in one process -----------------------------------------------------------


def test_close_releases_the_loop_and_a_second_loop_trains(tiny_loop):
    first = tiny_loop()
    first.fit(max_steps=2)
    first.close()
    assert first.train_data is None and first.networks["model"].optimizer is None
    second = tiny_loop()
    second.fit(max_steps=2)
    assert second.state.global_step == 2


def test_end_epoch_ends_the_epoch_as_if_its_data_ran_out(tiny_loop):
    class EndAt3:
        @hookimpl
        def after_step(self, loop):
            if loop.state.step_in_epoch == 3:
                loop.end_epoch()

    recorder = HookRecorder(hooks=["on_epoch_start", "on_epoch_end"])
    loop = tiny_loop([EndAt3(), recorder], eval_data=True)
    metrics = loop.fit(epochs=2)
    assert metrics != {}
    assert [c["epoch"] for c in recorder.calls_of("on_epoch_end")] == [0, 1]
    assert (loop.state.epoch, loop.state.step_in_epoch, loop.state.global_step) == (2, 0, 6)


def test_an_accelerator_whose_state_was_reset_is_named():
    from hookloop.testing import reset_accelerate, tiny_loop

    accelerator = Accelerator()
    reset_accelerate()  # what creating transformers.TrainingArguments does
    with pytest.raises(RuntimeError, match="state was reset after this Accelerator was created"):
        tiny_loop(accelerator=accelerator)


def test_a_default_built_in_gives_way_to_the_user_plugin_that_writes_its_key(caplog):
    """0.3 added ``perplexity`` to the default metrics: a 0.2 plugin writing it
    failed with a key collision. The user's value wins, said once (info)."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    from hookloop.testing import reset_accelerate

    class Perplexity:  # as ported run_clm_no_trainer.py scripts wrote it in 0.2
        @hookimpl
        def on_eval_end(self, metrics):
            metrics["perplexity"] = 2.0 ** metrics["eval_loss"]  # (not the default's exp)

    class EvalLoss:  # an after_eval_step value the default metrics also return
        @hookimpl
        def after_eval_step(self, batch, loop):
            n = batch["input_ids"].shape[0]
            return {"eval_loss": loop.accelerator.gather_for_metrics(torch.full((n,), 7.0))}

    reset_accelerate()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (8, 24))
    data = DataLoader([{"input_ids": ids[i], "labels": ids[i]} for i in range(8)], batch_size=4)
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
                eval_data=data, plugins=[Perplexity(), EvalLoss()], block=["progress"])
    with caplog.at_level(logging.INFO, logger="hookloop"):
        first = loop.fit(epochs=1)
        second = loop.fit(epochs=2)
    for metrics in (first, second):
        assert metrics["eval_loss"] == 7.0 and metrics["perplexity"] == 2.0 ** 7.0
    said = [r.getMessage() for r in caplog.records if "gives way" in r.getMessage()]
    assert len(said) == 2, said  # once per key, not once per evaluation
    assert any("'perplexity'" in m and "'metrics'" in m for m in said)
