"""docs/migrating.md keeps its promises: the port of run_glue_no_trainer.py
(docs/migrating_glue.py) trains as the script's own loop does, checkpoints,
tracks, resumes and saves as the script does, and its line counts are the
page's; the LightningModule port trains as Lightning does."""

import csv
import importlib.util
import json
import math
import random
import re

import pytest
import torch

from paths import ROOT, SCRIPTS  # noqa: F401

PAGE = ROOT / "docs" / "migrating.md"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def glue():
    return _module("migrating_glue")


WORDS = "the a film plot actor was is and very not".split()
POSITIVE, NEGATIVE = ["good", "great", "fun"], ["bad", "awful", "boring"]


@pytest.fixture(scope="module")
def tiny_glue(tmp_path_factory):
    """A two-layer BERT of width 32 and its tokeniser, saved as from_pretrained
    reads them, and a small sentiment task as CSV files (no hub)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    root = tmp_path_factory.mktemp("tiny-glue")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *POSITIVE, *NEGATIVE]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(root / "model")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(root / "model")
    rng = random.Random(0)
    for split, n in (("train", 64), ("validation", 24)):
        with open(root / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            for i in range(n):
                label = i % 2
                words = rng.sample(WORDS, 4) + [rng.choice(POSITIVE if label else NEGATIVE)]
                rng.shuffle(words)
                writer.writerow([" ".join(words), ["neg", "pos"][label]])
    return root


def glue_argv(root, out, *extra):
    return ["--model_name_or_path", str(root / "model"), "--train_file", str(root / "train.csv"),
            "--validation_file", str(root / "validation.csv"), "--max_length", "16",
            "--learning_rate", "1e-3", "--num_train_epochs", "2", "--seed", "0",
            "--output_dir", str(out), *extra]


def script_loop(glue, args, corrected=False, groups=None):
    """run_glue_no_trainer.py's own training loop (its lines 549-581 and the
    evaluation 583-600, one process), on the port's model, data, optimizer and
    scheduler. With ``--gradient_accumulation_steps k`` it updates when ``step %
    k == 0`` (transformers issue 15801); ``corrected``: ``(step + 1) % k == 0``.
    ``groups``: the number of batches of each update is appended to it."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator()
    set_seed(args.seed)
    model, _, train_dataloader, eval_dataloader = glue.build(args, accelerator)
    optimizer, lr_scheduler = glue.optimizer_and_scheduler(args, model, train_dataloader)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    k = args.gradient_accumulation_steps
    max_train_steps = args.num_train_epochs * math.ceil(len(train_dataloader) / k)  # (its lines 459-462)
    accuracies, completed, batches = [], 0, 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            accelerator.backward(outputs.loss / k)
            batches += 1
            if (step + 1 if corrected else step) % k == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed += 1
                if groups is not None:
                    groups.append(batches)
                batches = 0
            if completed >= max_train_steps:
                break
        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            total += len(references)
        accuracies.append(correct / total)
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()], accuracies


def test_the_glue_port_trains_as_the_script_s_loop_bit_for_bit(glue, tiny_glue, tmp_path):
    from hookloop.testing import reset_accelerate

    argv = glue_argv(tiny_glue, tmp_path / "out", "--checkpointing_steps", "epoch",
                     "--with_tracking", "--report_to", "tensorboard")
    loop, metrics = glue.main(argv)
    ours = [p.detach().clone() for p in loop.networks["model"].unwrapped.parameters()]
    assert loop.state.global_step == 2 * 8  # 64 examples, batches of 8, 2 epochs
    loop.close()

    reset_accelerate()
    theirs, accuracies = script_loop(glue, glue.parse_args(argv))
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert metrics["eval_accuracy"] == pytest.approx(accuracies[-1], abs=1e-9)
    assert {"eval_loss", "eval_accuracy", "eval_f1", "train_loss"} <= set(metrics)
    # what the script leaves behind: the model and tokeniser, all_results.json
    out = tmp_path / "out"
    assert json.loads((out / "all_results.json").read_text())["eval_accuracy"] == metrics["eval_accuracy"]
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), ours))
    assert saved.config.id2label == {0: "neg", 1: "pos"}


def test_porting_fixes_the_script_s_accumulation_and_matches_it_once_its_line_is_corrected(glue, tiny_glue,
                                                                                            tmp_path):
    """docs/migrating.md, Gradient accumulation: the script's ``step % k == 0``
    makes the first update of every epoch from one batch, and the run stops
    before the end of its last epoch; the port does what Accelerate's
    ``accumulate`` means, and equals the script with ``(step + 1) % k == 0``."""
    from hookloop.testing import reset_accelerate

    argv = glue_argv(tiny_glue, tmp_path / "out", "--gradient_accumulation_steps", "2")
    loop, _ = glue.main(argv)  # 8 batches an epoch, 2 epochs: 4 updates of 2 batches an epoch
    ours = [p.detach().clone() for p in loop.networks["model"].unwrapped.parameters()]
    assert loop.state.global_step == 8 and loop.state.micro_step == 16
    loop.close()
    for corrected in (False, True):
        reset_accelerate()
        groups = []
        theirs, _ = script_loop(glue, glue.parse_args(argv), corrected=corrected, groups=groups)
        if corrected:
            assert groups == [2] * 8
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))  # bit for bit
        else:  # batches 0 | 1 2 | 3 4 | 5 6 | 7, then 0 | 1 2 | 3 4 and max_train_steps: 8 updates
            assert groups == [1, 2, 2, 2, 1, 1, 2, 2]
            assert sum(groups) == 13 and not all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_glue_port_checkpoints_tracks_and_resumes(glue, tiny_glue, tmp_path):
    from hookloop.testing import reset_accelerate
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    argv = glue_argv(tiny_glue, out, "--checkpointing_steps", "4", "--with_tracking",
                     "--report_to", "tensorboard", "--gradient_accumulation_steps", "2")
    loop, metrics = glue.main(argv)
    # 8 batches per epoch in updates of 2: 4 updates per epoch; the linear schedule ends at 0
    assert loop.state.global_step == 8
    assert loop.networks["model"].optimizer.param_groups[0]["lr"] == 0.0
    runs = sorted((out / "checkpoints").iterdir())
    names = sorted(p.name for p in runs[0].iterdir() if p.name.startswith("step-"))
    # every 4 updates (here also the epochs' last updates, saved again after their evaluations)
    assert {"step-00000004", "step-00000008"} <= set(names), names
    events = [p for p in out.rglob("events.out.tfevents*")]
    tags = set()
    for path in events:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    assert {"train_loss", "eval_accuracy", "eval_f1", "epoch"} <= tags, tags
    final = [p.detach().clone() for p in loop.networks["model"].unwrapped.parameters()]
    loop.close()

    # resumed from the first epoch's checkpoint, the second epoch ends where the whole run did
    reset_accelerate()
    resumed, again = glue.main(glue_argv(tiny_glue, tmp_path / "again", "--gradient_accumulation_steps", "2",
                                         "--resume_from_checkpoint", str(runs[0] / "step-00000004")))
    assert resumed.state.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(resumed.networks["model"].unwrapped.parameters(), final))
    assert again["eval_accuracy"] == metrics["eval_accuracy"]


def test_a_bad_checkpointing_steps_is_refused_naming_it(glue, tiny_glue, tmp_path, capsys):
    with pytest.raises(SystemExit):
        glue.parse_args(glue_argv(tiny_glue, tmp_path, "--checkpointing_steps", "every"))
    assert "--checkpointing_steps is a number of steps or 'epoch', got 'every'" in capsys.readouterr().err


def test_the_page_s_line_counts_of_the_port_are_the_counter_s(glue):
    count = _module("count_lines")
    source = (ROOT / "docs" / "migrating_glue.py").read_text()
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("# -- what replaces"))
    last = next(i for i, line in enumerate(lines, 1) if line.startswith("def main(")) - 1
    text = PAGE.read_text()
    whole = re.search(r"\| the whole file \| (\d+) \| (\d+) \|", text)
    training = re.search(r"\| the training \(script lines 472-639[^|]*\| (\d+) \| (\d+) \|", text)
    assert int(whole.group(2)) == count.code_lines(source)
    assert int(training.group(2)) == count.code_lines(source, first, last)
    # the counter's rule: docstrings, comments and blank lines are not code
    assert count.code_lines('"""doc\nmore"""\n\n# note\nx = (1,\n     2)  # two lines\n') == 2


# -- the LightningModule section ---------------------------------------------------


def lightning_blocks():
    """``(setup, lightning, hookloop, early_stopping)``: the section's Python blocks."""
    section = PAGE.read_text().split("\n## From a LightningModule\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


class _Record:
    """The learning rate at each epoch's start and every update's loss."""

    def __init__(self):
        self.lrs, self.losses = [], []


def _train_both(setup, lightning, port, tmp_path):
    """Run the page's Lightning and hookloop versions from a fresh ``setup`` each;
    ``(theirs, ours, trainer, loop, metrics)`` with what each recorded."""
    import lightning as L

    from hookloop import hookimpl
    from hookloop.testing import reset_accelerate

    theirs, ours = _Record(), _Record()

    class LightningRecorder(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            theirs.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            theirs.losses.append(outputs["loss"].detach().clone())

    class Recorder:
        @hookimpl
        def on_epoch_start(self, loop):
            ours.lrs.append(loop.networks["model"].optimizer.param_groups[0]["lr"])

        @hookimpl
        def after_step(self, loss):
            ours.losses.append(loss.detach().clone())

    namespace = {"recorder": LightningRecorder()}
    exec(compile(setup, "docs/migrating.md:setup", "exec"), namespace)
    exec(compile(lightning.replace("callbacks=[", "callbacks=[recorder, "), "docs/migrating.md:lightning",
                 "exec"), namespace)
    trainer = namespace["trainer"]
    theirs.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])  # after the last epoch's step
    theirs.params = [p.detach().clone() for p in trainer.lightning_module.parameters()]

    reset_accelerate()
    namespace["recorder"] = Recorder()
    exec(compile(setup, "docs/migrating.md:setup", "exec"), namespace)  # a fresh loader and generator
    exec(compile(port.replace("plugins=[", "plugins=[recorder, "), "docs/migrating.md:hookloop", "exec"),
         namespace)
    loop = namespace["loop"]
    ours.lrs.append(loop.networks["model"].optimizer.param_groups[0]["lr"])
    ours.params = [p.detach().clone() for p in loop.networks["model"].unwrapped.parameters()]
    return theirs, ours, trainer, loop, namespace["metrics"]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_lightning_module_and_its_hookloop_port_train_alike(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    setup, lightning, port, _ = lightning_blocks()
    monkeypatch.chdir(tmp_path)
    theirs, ours, trainer, _, metrics = _train_both(setup, lightning, port, tmp_path)
    assert trainer.current_epoch == 6 and not trainer.should_stop  # early stopping did not end it
    # the plateau scheduler stepped after epochs 2, 4 and 6 on val_loss, in both, and cut the rate
    assert ours.lrs == theirs.lrs == [0.5] * 6 + [0.25], (ours.lrs, theirs.lrs)
    # the first epoch's updates bit for bit; then the shuffles differ (Lightning does not run
    # an epoch's loader out, so torch's RandomSampler skips the permutation it draws at the end)
    assert len(ours.losses) == len(theirs.losses) == 6 * 12
    assert _equal(ours.losses[:12], theirs.losses[:12]) and not _equal(ours.losses, theirs.losses)
    assert set(metrics) == {"train_loss", "val_loss", "val_acc"}
    lightning_val = float(trainer.callback_metrics["val_loss"])
    assert abs(metrics["val_loss"] - lightning_val) < 0.05, (metrics["val_loss"], lightning_val)


def test_without_shuffling_lightning_and_hookloop_train_bit_for_bit(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    setup, lightning, port, _ = lightning_blocks()
    monkeypatch.chdir(tmp_path)
    assert "shuffle=True" in setup
    theirs, ours, trainer, _, metrics = _train_both(setup.replace("shuffle=True", "shuffle=False"),
                                                       lightning, port, tmp_path)
    assert ours.lrs == theirs.lrs and len(set(ours.lrs)) > 1, (ours.lrs, theirs.lrs)
    assert _equal(ours.losses, theirs.losses) and len(ours.losses) == 6 * 12
    assert _equal(ours.params, theirs.params)
    # the validation loss: a mean over examples here, of (equal-sized) batch means there
    assert metrics["val_loss"] == pytest.approx(float(trainer.callback_metrics["val_loss"]), rel=1e-6)


def test_early_stopping_from_its_distribution_runs_in_the_port(tmp_path, monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "plugins" / "hookloop-early-stopping" / "src"))
    monkeypatch.chdir(tmp_path)
    setup, _, port, early = lightning_blocks()
    namespace = {}
    exec(compile(setup, "docs/migrating.md:setup", "exec"), namespace)
    exec(compile(port.split("\n\nnet = make_net()", 1)[0], "docs/migrating.md:plugins", "exec"), namespace)
    exec(compile(early, "docs/migrating.md:early-stopping", "exec"), namespace)
    stopping = namespace["loop"].plugins.get("early-stopping")
    assert stopping.best is not None and namespace["loop"].state.epoch >= 1
    assert "hookloop_early_stopping" in sys.modules
