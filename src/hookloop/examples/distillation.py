"""Distil the text example's fine-tuned MiniLM into a tiny BERT, with hookloop's
:class:`~hookloop.strategies.Distillation` strategy.

The task is the text example's (:mod:`hookloop.examples.text_classification`):
the VADER sentiment lexicon, 7,506 human-rated words labelled positive or
negative, 6,004 to train on and 1,502 held out. The teacher is the
all-MiniLM-L6-v2 BERT (22.7 M parameters) fine-tuned on it; when
``--teacher DIR`` holds no model yet, the demo fine-tunes one first with the
text example's own code (one epoch, about a minute here) and saves it there,
so the next run starts at once.

The student is a BERT built from a config, ``BertConfig(hidden_size=128,
num_hidden_layers=2, ...)``. The held-out words are not in the training set,
and a student trained from scratch would know nothing of their tokens; so, as
DistilBERT started from its teacher's weights, the student's token embeddings
start as the teacher's, reduced to ``hidden_size`` dimensions by PCA
(``--student-init random`` starts from random ones). Two students start from the
same weights and see the same batches: one trained on the labels alone
(the supervised strategy), one distilled (soft targets at ``--temperature``
plus the labels, weighted by ``--alpha``).

Run it::

    pip install "hookloop[text]"             # transformers, datasets, ...
    hookloop demo distill                    # fine-tunes the teacher on first use
    hookloop demo distill --teacher hookloop-runs/distill/teacher --epochs 5 --alpha 0.9

It prints the teacher's held-out accuracy, both students' accuracies, and the
size and speed (ms per batch of 32, forward only) of student and teacher. The
teacher and its fine-tuning log go to ``./hookloop-runs/distill`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

from . import text_classification as tc
from .demo_support import default_out, require_extra

DEFAULT_OUT = default_out("distill")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hookloop demo distill",
        description="Distil the text example's fine-tuned MiniLM into a tiny BERT on the VADER task. "
                    'Needs the text extra: pip install "hookloop[text]".',
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"where the teacher and logs go (./{DEFAULT_OUT})")
    p.add_argument("--teacher", default=None, help=(
        "a fine-tuned two-label classifier (a save_pretrained directory); fine-tuned from "
        "--teacher-base and saved there first if it holds none (default: OUT/teacher)"))
    p.add_argument("--teacher-base", default=tc.MINILM, help=(
        f"what to fine-tune when there is no teacher: '{tc.MINILM}' (the packaged "
        "all-MiniLM-L6-v2, default) or a local directory"))
    p.add_argument("--teacher-epochs", type=int, default=1, help="fine-tuning epochs (1)")
    p.add_argument("--teacher-lr", type=float, default=1e-4, help="fine-tuning peak lr (1e-4)")
    p.add_argument("--epochs", type=int, default=3, help="student epochs (3)")
    p.add_argument("--batch-size", type=int, default=32, help="32")
    p.add_argument("--lr", type=float, default=1e-3, help="student peak lr, Adam, linear warm-up (1e-3)")
    p.add_argument("--temperature", type=float, default=2.0, help="softens the targets (2.0)")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the soft targets (0.5)")
    p.add_argument("--hidden", type=int, default=128, help="student hidden size (128)")
    p.add_argument("--layers", type=int, default=2, help="student layers (2)")
    p.add_argument("--heads", type=int, default=2, help="student attention heads (2)")
    p.add_argument("--student-init", choices=["teacher-embeddings", "random"],
                   default="teacher-embeddings", help="the student's token embeddings at the start")
    p.add_argument("--freeze-embeddings", action="store_true", help=(
        "keep the student's token embeddings as initialised (3x faster steps, "
        "lower accuracy here)"))
    p.add_argument("--max-length", type=int, default=32, help="tokens per text")
    p.add_argument("--max-train-examples", type=int, default=None, help="use a subset")
    p.add_argument("--max-eval-examples", type=int, default=None, help="use a subset")
    p.add_argument("--seed", type=int, default=0, help="student weights, shuffling, dropout")
    p.add_argument("--split-seed", type=int, default=0, help="the train/test split")
    p.add_argument("--speed-batches", type=int, default=20, help="batches timed per model (20)")
    args = p.parse_args(argv)
    for name in ("teacher_epochs", "epochs", "batch_size", "hidden", "layers", "heads",
                 "max_length", "max_train_examples", "max_eval_examples", "speed_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.teacher is None:
        args.teacher = os.path.join(args.out, "teacher")
    return args


# -- the teacher -----------------------------------------------------------------


def has_model(directory) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))


def fine_tune_teacher(args) -> float:
    """Fine-tune ``--teacher-base`` with the text example's :func:`run` and
    save model and tokenizer to ``--teacher``; returns the wall time."""
    start = time.perf_counter()
    argv = ["--model", args.teacher_base, "--epochs", str(args.teacher_epochs),
            "--lr", str(args.teacher_lr), "--batch-size", str(args.batch_size),
            "--max-length", str(args.max_length), "--seed", str(args.seed),
            "--split-seed", str(args.split_seed), "--output-dir", os.path.join(args.out, "teacher-log")]
    if args.max_train_examples is not None:
        argv += ["--max-train-examples", str(args.max_train_examples)]
    if args.max_eval_examples is not None:
        argv += ["--max-eval-examples", str(args.max_eval_examples)]
    result = tc.run(tc.parse_args(argv))
    loop = result.loop
    if loop.accelerator.is_main_process:
        tokenizer, _ = tc.load_model(result.model_ref)
        loop.networks["model"].unwrapped.save_pretrained(args.teacher)
        tokenizer.save_pretrained(args.teacher)
    loop.accelerator.wait_for_everyone()
    loop.close()
    return time.perf_counter() - start


# -- the student -----------------------------------------------------------------


def build_student(teacher, args):
    """A BERT classifier from a config; token embeddings from the teacher's
    (PCA to ``hidden`` dimensions) unless ``--student-init random``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    t = teacher.config
    config = BertConfig(
        vocab_size=t.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
        max_position_embeddings=max(64, args.max_length),
        type_vocab_size=getattr(t, "type_vocab_size", 2), pad_token_id=t.pad_token_id or 0,
        num_labels=2, id2label=tc.LABELS,
        label2id={v: k for k, v in tc.LABELS.items()},
    )
    student = BertForSequenceClassification(config)
    if args.student_init == "teacher-embeddings":
        width = teacher.get_input_embeddings().weight.shape[1]
        if args.hidden > width:
            raise ValueError(f"--hidden {args.hidden} is wider than the teacher's embeddings "
                             f"({width}): choose at most {width}, or --student-init random")
        embeddings = student.get_input_embeddings().weight
        with torch.no_grad():
            embeddings.copy_(pca(teacher.get_input_embeddings().weight.detach().float(), args.hidden))
        embeddings.requires_grad_(not args.freeze_embeddings)
    return student


def pca(x, k):
    """The rows of ``x`` projected on their ``k`` principal components, scaled
    to the spread of the original rows."""
    import torch

    centered = x - x.mean(0)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)
    projected = centered @ v[:k].T
    return projected * (centered.std() / projected.std())


def n_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# -- training and measuring ------------------------------------------------------


def train_student(student, data, tokenizer, args, teacher=None):
    """Train ``student`` for ``--epochs``: on the labels (no teacher) or
    distilled from ``teacher``. Returns (metrics, wall time)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from ..loop import Loop
    from ..network import Network
    from ..strategies import Distillation

    set_seed(args.seed)  # the same batches and dropout for both students
    train, test = tc.make_dataloaders(data, tokenizer, args.batch_size)
    optimizer, scheduler = make_optimizer(student, len(train) * args.epochs, args.lr)
    accelerator = Accelerator()
    if teacher is None:
        loop = Loop(model=student, optimizer=optimizer, scheduler=scheduler,
                    train_data=train, eval_data=test, accelerator=accelerator,
                    plugins=[tc.EpochReport()])
    else:
        loop = Loop(
            networks={"teacher": Network(teacher, None),
                      "student": Network(student, optimizer, scheduler)},
            strategy=Distillation(temperature=args.temperature, alpha=args.alpha),
            train_data=train, eval_data=test, accelerator=accelerator, plugins=[tc.EpochReport()],
        )
    start = time.perf_counter()
    metrics = loop.fit(epochs=args.epochs)
    wall = time.perf_counter() - start
    loop.close()
    return metrics, wall


def make_optimizer(model, num_training_steps, lr):
    """Adam (the fused kernel where torch has it: the student's 3.9 M embedding
    parameters make the update the larger part of its step) and the text
    example's schedule: linear warm-up over 10 % of the steps, then decay."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    try:
        optimizer = torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError):  # no fused CPU Adam before torch 2.4
        optimizer = torch.optim.Adam(params, lr=lr)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(0.1 * num_training_steps), num_training_steps=num_training_steps)
    return optimizer, scheduler


def accuracy(model, data, tokenizer, args) -> float:
    """Held-out accuracy of a classifier, one process."""
    import torch

    _, test = tc.make_dataloaders(data, tokenizer, args.batch_size)
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in test:
            logits = model(**batch).logits
            correct += (logits.argmax(-1) == batch["labels"]).sum().item()
            total += batch["labels"].numel()
    return correct / max(total, 1)


def ms_per_batch(models, data, tokenizer, args) -> list[float]:
    """Median forward time of one held-out batch for each model, in
    milliseconds, over ``--speed-batches`` batches after a warm-up one. The
    models take turns on each batch, so that other work on the machine slows
    them alike."""
    import torch

    _, test = tc.make_dataloaders(data, tokenizer, args.batch_size)
    times: list[list[float]] = [[] for _ in models]
    for model in models:
        model.eval()
    with torch.no_grad():
        for i, batch in enumerate(test):
            batch = {k: v for k, v in batch.items() if k != "labels"}
            for model, spent in zip(models, times):
                start = time.perf_counter()
                model(**batch)
                if i:
                    spent.append(time.perf_counter() - start)
            if i == args.speed_batches:
                break
    return [1000 * statistics.median(t) if t else float("nan") for t in times]


@dataclass
class Report:
    teacher_accuracy: float
    labels_only_accuracy: float
    distilled_accuracy: float
    teacher_params: int
    student_params: int
    teacher_ms: float
    student_ms: float
    teacher_fine_tune_s: float | None
    labels_only_s: float
    distilled_s: float
    wall_s: float


def run(args) -> Report:
    import copy

    from accelerate.utils import set_seed

    start = time.perf_counter()
    tuned = None
    if not has_model(args.teacher):
        print(f"no fine-tuned teacher in {args.teacher}: fine-tuning {args.teacher_base} "
              f"for {args.teacher_epochs} epoch(s) first (the text example's code)")
        tuned = fine_tune_teacher(args)
    tokenizer, teacher = tc.load_model(args.teacher)
    data = tc.load_data(tokenizer, args)
    teacher_accuracy = accuracy(teacher, data, tokenizer, args)
    print(f"teacher: held-out accuracy {teacher_accuracy:.4f}")

    set_seed(args.seed)
    student = build_student(teacher, args)
    twin = copy.deepcopy(student)  # both students start from the same weights
    print(f"student, labels only ({args.epochs} epochs):")
    labels_only, labels_only_s = train_student(student, data, tokenizer, args)
    print(f"student, distilled (T={args.temperature}, alpha={args.alpha}, {args.epochs} epochs):")
    distilled, distilled_s = train_student(twin, data, tokenizer, args, teacher=teacher)
    teacher_ms, student_ms = ms_per_batch([teacher, twin], data, tokenizer, args)
    return Report(
        teacher_accuracy=teacher_accuracy,
        labels_only_accuracy=labels_only["eval_accuracy"],
        distilled_accuracy=distilled["eval_accuracy"],
        teacher_params=n_parameters(teacher), student_params=n_parameters(twin),
        teacher_ms=teacher_ms, student_ms=student_ms,
        teacher_fine_tune_s=tuned, labels_only_s=labels_only_s, distilled_s=distilled_s,
        wall_s=time.perf_counter() - start,
    )


def format_report(r: Report, args) -> str:
    shape = f"BERT {args.layers} layers x {args.hidden}"
    rows = [
        ("teacher: fine-tuned MiniLM-L6", r.teacher_accuracy, r.teacher_params, r.teacher_ms),
        (f"student: {shape}, labels only", r.labels_only_accuracy, r.student_params, r.student_ms),
        (f"student: {shape}, distilled", r.distilled_accuracy, r.student_params, r.student_ms),
    ]
    lines = [f"{'model':<40} {'accuracy':>8} {'params':>8} {'ms/batch':>9}"]
    for name, acc, params, ms in rows:
        lines.append(f"{name:<40} {acc:>8.4f} {params / 1e6:>7.1f}M {ms:>9.1f}")
    lines.append(
        f"student: {r.student_params / r.teacher_params:.1%} of the teacher's parameters, "
        f"{r.teacher_ms / r.student_ms:.1f}x faster (forward, batch {args.batch_size}); "
        f"distillation {r.distilled_accuracy - r.labels_only_accuracy:+.4f} accuracy over labels only"
    )
    tuned = "" if r.teacher_fine_tune_s is None else f"teacher fine-tuning {r.teacher_fine_tune_s:.0f} s, "
    lines.append(f"wall time {r.wall_s:.0f} s ({tuned}students {r.labels_only_s:.0f} s and "
                 f"{r.distilled_s:.0f} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``hookloop demo distill [options]``; ``--help`` lists them."""
    args = parse_args(argv)
    missing = require_extra("distill")
    if missing is not None:
        return missing
    try:
        report = run(args)
    except tc.ModelUnavailable as exc:
        print(f"hookloop demo distill: {exc}", file=sys.stderr)
        return 2
    print(format_report(report, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
