"""The reference workload's workload: fine-tuning a transformer for sequence classification
(hookloop.examples.text_classification) trains exactly like the hand-written
Accelerate loop, follows the warm-up schedule, runs offline, and runs in two
processes with one log and every test example counted once."""

import json
import os

import launching
import pytest
import torch

from hookloop.examples import text_classification as tc
from hookloop.testing import reset_accelerate
from paths import ROOT, SCRIPTS  # noqa: F401

TWO_PROCESSES = str(SCRIPTS / "text_two_processes.py")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A ~1M-parameter DistilBERT classifier (with dropout) and a BERT
    tokenizer, written by save_pretrained: a local model for ``--model DIR``,
    loaded back through the real from_pretrained path."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-distilbert")
    torch.manual_seed(0)
    config = DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=2)
    DistilBertForSequenceClassification(config).save_pretrained(path)
    # the MiniLM vocabulary is BERT's (30522 tokens, as DistilBERT's default);
    # DistilBERT takes no token_type_ids
    tokenizer = AutoTokenizer.from_pretrained(
        tc.minilm_path(), model_input_names=["input_ids", "attention_mask"]
    )
    tokenizer.save_pretrained(path)
    return str(path)


def _args(model_dir, out, *extra):
    return tc.parse_args(["--model", model_dir, "--output-dir", str(out), *extra])


def _log(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _hand_written(model_dir, args):
    """The reference workload's loop, by hand: same seed, same data, same recipe. Evaluates
    after each epoch as the reference workload does (a DataLoader iterator draws from the
    global RNG, so skipping evaluation would change the next epoch)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.optim import Adam
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        get_linear_schedule_with_warmup,
    )

    accelerator = Accelerator(device_placement=True)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    data = tc.load_data(tokenizer, args)
    collate = DataCollatorWithPadding(tokenizer)
    train_dataloader = DataLoader(data["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    eval_dataloader = DataLoader(data["test"], batch_size=args.batch_size, collate_fn=collate)
    num_epochs = args.epochs
    optimizer = Adam(params=model.parameters(), lr=args.lr)
    num_training_steps = len(train_dataloader) * num_epochs
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(0.1 * num_training_steps), num_training_steps=num_training_steps
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    accuracies = []
    for _ in range(num_epochs):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                logits = model(**batch).logits
            predictions, references = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accuracies.append(correct / total)
    return accelerator.unwrap_model(model), accuracies


def test_parity_with_the_hand_written_loop_of_the_brief(tiny_model_dir, tmp_path):
    # lr 1e-3 so that two epochs move every parameter visibly; 60 examples in
    # batches of 8: a short last batch, a shuffled order, dropout on
    args = _args(tiny_model_dir, tmp_path, "--epochs", "2", "--batch-size", "8", "--lr", "1e-3",
                 "--max-train-examples", "60", "--max-eval-examples", "21")
    result = tc.run(args)
    ours = result.loop.networks["model"].unwrapped
    reset_accelerate()
    theirs, accuracies = _hand_written(tiny_model_dir, args)

    before = tc.load_model(tiny_model_dir)[1]
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), ours.parameters()))
    names = [n for n, _ in ours.named_parameters()]
    assert names == [n for n, _ in theirs.named_parameters()]
    for name, a, b in zip(names, ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert result.metrics["eval_accuracy"] == accuracies[-1]
    logged = [r["eval_accuracy"] for r in _log(result.log_path) if "eval_accuracy" in r]
    assert logged == accuracies


def test_logged_learning_rate_warms_up_over_ten_percent_then_decays(tiny_model_dir, tmp_path):
    # 36 examples / batch 4 = 9 batches, 3 epochs: 27 steps, warm-up int(2.7) = 2
    args = _args(tiny_model_dir, tmp_path, "--epochs", "3", "--batch-size", "4", "--log-every", "1",
                 "--max-train-examples", "36", "--max-eval-examples", "4")
    result = tc.run(args)
    lr = {r["step"]: r["lr"] for r in _log(result.log_path) if "lr" in r}
    total, warmup, peak = 27, 2, 2e-5
    assert sorted(lr) == list(range(1, total + 1))
    # logged after the step: `s` scheduler steps done
    assert lr[1] == pytest.approx(peak * 1 / warmup)
    assert lr[2] == pytest.approx(peak)
    for step in (3, 10, 20, 26):
        assert lr[step] == pytest.approx(peak * (total - step) / (total - warmup)), step
    assert lr[total] == 0.0


def test_default_model_falls_back_to_the_packaged_minilm_offline(tmp_path, monkeypatch, capsys):
    """The real example, offline: MiniLM on a small VADER subset, a few steps."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tc, "_in_hub_cache", lambda name: False)  # whatever this machine cached
    argv = ["--max-train-examples", "48", "--max-eval-examples", "25", "--batch-size", "16",
            "--max-steps", "3", "--log-every", "1", "--output-dir", str(tmp_path)]
    assert tc.main(argv) == 0
    out = capsys.readouterr().out
    assert "'distilbert-base-cased' is not available" in out
    assert "HF_HUB_OFFLINE" in out
    assert "held-out accuracy" in out and "on 25 examples" in out
    records = _log(tmp_path / f"{tc.LOG_NAME}.jsonl")
    assert records[0]["config"]["model_path"] == tc.minilm_path()
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]


def test_a_model_named_explicitly_fails_fast_offline_with_the_local_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tc, "_in_hub_cache", lambda name: False)
    assert tc.main(["--model", "distilbert-base-cased", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot load the model 'distilbert-base-cased'" in err
    assert f"--model {tc.minilm_path()}" in err
    assert "--model minilm" in err


def test_model_aliases_and_local_directories_need_no_hub(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert tc.resolve_model("minilm") == (tc.minilm_path(), None)
    assert tc.resolve_model(tiny_model_dir) == (tiny_model_dir, None)
    with pytest.raises(tc.ModelUnavailable, match="cannot load the model 'no/such-model'"):
        tc.resolve_model("no/such-model")


def test_vader_lexicon_labels_and_split():
    from hookloop.examples.vader_data import load_vader

    data = load_vader(seed=0)
    train, test = data["train"], data["test"]
    assert len(train) + len(test) == 7506  # 7,520 lines, 14 tokens listed twice
    assert len(test) == pytest.approx(0.2 * 7506, abs=1)
    assert not set(train["text"]) & set(test["text"])
    for row in (train[i] for i in range(50)):
        assert row["label"] == int(row["mean"] > 0) and row["mean"] != 0
    # tokens pandas would turn into booleans or NaN stay text
    assert "true" in set(train["text"]) | set(test["text"])
    assert load_vader(seed=0)["test"]["text"] == test["text"]


@pytest.mark.slow
def test_two_processes_same_parameters_each_example_once_one_log(tiny_model_dir, tmp_path):
    report = tmp_path / "report.json"
    out = tmp_path / "run"
    args = [
        str(report), "--cpu", "--model", tiny_model_dir, "--output-dir", str(out), "--epochs", "2",
        "--batch-size", "8", "--lr", "1e-3", "--log-every", "1",
        # 37 test examples in batches of 8 over 2 processes: the last batch is
        # uneven and Accelerate pads it with repeated examples
        "--max-train-examples", "40", "--max-eval-examples", "37",
    ]
    proc = launching.run_two(TWO_PROCESSES, *args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["num_processes"] == 2 and r["process_indices"] == [0, 1]
    assert r["same_parameters"]
    # every evaluation (one per epoch) counted each of the 37 examples exactly once
    assert r["num_test"] == 37 and r["eval_counts"] == [37, 37]
    assert r["gathered_losses"] == pytest.approx(r["reference_losses"], abs=1e-5)
    assert r["gathered_correct"] == r["reference_correct"]
    assert r["eval_accuracy"] == pytest.approx(r["reference_correct"] / 37)
    # one log, written by one process: each step once
    assert os.listdir(out) == [f"{tc.LOG_NAME}.jsonl"]
    records = _log(out / f"{tc.LOG_NAME}.jsonl")
    assert sum("config" in rec for rec in records) == 1
    steps = [rec["step"] for rec in records if "loss" in rec]
    assert steps == list(range(1, r["global_step"] + 1)) and r["global_step"] == 6
    assert [rec["epoch"] for rec in records if "epoch" in rec] == [0, 1]
