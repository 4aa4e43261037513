"""run_glue_no_trainer.py (Hugging Face transformers' examples/pytorch/text-classification),
ported to hookloop: docs/migrating.md puts the two side by side.

The model, tokeniser, data, optimizer and scheduler are built by the script's own
lines (:func:`build`, :func:`optimizer_and_scheduler`); the hand-written training
loop, its checkpointing, resuming, tracking and evaluation became one
:class:`hookloop.Loop` and its plugins (:func:`train`). Run it as the script::

    accelerate launch docs/migrating_glue.py --model_name_or_path bert-base-cased \\
        --task_name mrpc --output_dir out --checkpointing_steps epoch --with_tracking

Left out of the port: ``--push_to_hub`` and its hub options, ``--use_slow_tokenizer``,
``--trust_remote_code``, ``--ignore_mismatched_sizes``, regression (``stsb``) and MNLI's
second (mismatched) evaluation.
"""

import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    PretrainedConfig,
    default_data_collator,
    get_scheduler,
)

from hookloop import Loop, hookimpl
from hookloop.plugins import Checkpoint, Logger, TrainLoss

task_to_keys = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "wnli": ("sentence1", "sentence2"),
}
SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a text classification task")
    parser.add_argument("--task_name", type=str, default=None, choices=list(task_to_keys))
    parser.add_argument("--train_file", type=str, default=None, help="A csv or a json file: training data.")
    parser.add_argument("--validation_file", type=str, default=None, help="A csv or a json file: validation data.")
    parser.add_argument("--max_length", type=int, default=128, help="Tokens per example, after truncation.")
    parser.add_argument("--pad_to_max_length", action="store_true", help="Pad every example to max_length.")
    parser.add_argument("--model_name_or_path", type=str, required=True, help="Local path or hub model name.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5, help="Peak learning rate, after warm-up.")
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=None, help="Overrides num_train_epochs.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear", choices=SCHEDULERS)
    parser.add_argument("--num_warmup_steps", type=int, default=0, help="Warm-up steps of the schedule.")
    parser.add_argument("--output_dir", type=str, default=None, help="Where to store the final model.")
    parser.add_argument("--seed", type=int, default=None, help="A seed for reproducible training.")
    parser.add_argument("--checkpointing_steps", type=str, default=None, help="Save every n steps, or 'epoch'.")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None, help="A checkpoint, or 'latest'.")
    parser.add_argument("--with_tracking", action="store_true", help="Log to experiment trackers.")
    parser.add_argument("--report_to", type=str, default="all", help="The trackers (with --with_tracking).")
    args = parser.parse_args(argv)
    if args.task_name is None and args.train_file is None and args.validation_file is None:
        parser.error("need either --task_name or --train_file / --validation_file")
    for path in (args.train_file, args.validation_file):
        if path is not None and path.split(".")[-1] not in ("csv", "json"):
            parser.error(f"{path}: a data file is a csv or a json file")
    if args.checkpointing_steps not in (None, "epoch") and not args.checkpointing_steps.isdigit():
        parser.error(f"--checkpointing_steps is a number of steps or 'epoch', got {args.checkpointing_steps!r}")
    return args


def build(args, accelerator):
    """The script's model, tokeniser and data loaders: its lines 251-441, unchanged
    but for what the port leaves out."""
    if args.task_name is not None:
        raw_datasets = load_dataset("nyu-mll/glue", args.task_name)
        label_list = raw_datasets["train"].features["label"].names
    else:
        data_files = {}
        if args.train_file is not None:
            data_files["train"] = args.train_file
        if args.validation_file is not None:
            data_files["validation"] = args.validation_file
        extension = (args.train_file if args.train_file is not None else args.validation_file).split(".")[-1]
        raw_datasets = load_dataset(extension, data_files=data_files)
        label_list = sorted(raw_datasets["train"].unique("label"))
    num_labels = len(label_list)

    config = AutoConfig.from_pretrained(args.model_name_or_path, num_labels=num_labels, finetuning_task=args.task_name)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, config=config)

    if args.task_name is not None:
        sentence1_key, sentence2_key = task_to_keys[args.task_name]
    else:
        non_label_column_names = [name for name in raw_datasets["train"].column_names if name != "label"]
        if "sentence1" in non_label_column_names and "sentence2" in non_label_column_names:
            sentence1_key, sentence2_key = "sentence1", "sentence2"
        elif len(non_label_column_names) >= 2:
            sentence1_key, sentence2_key = non_label_column_names[:2]
        else:
            sentence1_key, sentence2_key = non_label_column_names[0], None

    # The model's own label order when it names the dataset's labels; else the dataset's.
    label_to_id = None
    if model.config.label2id != PretrainedConfig(num_labels=num_labels).label2id and args.task_name is not None:
        label_name_to_id = {k.lower(): v for k, v in model.config.label2id.items()}
        if sorted(label_name_to_id) == sorted(label_list):
            label_to_id = {i: label_name_to_id[label_list[i]] for i in range(num_labels)}
    elif args.task_name is None:
        label_to_id = {v: i for i, v in enumerate(label_list)}
    if label_to_id is not None:
        model.config.label2id = label_to_id
    else:
        model.config.label2id = {label: i for i, label in enumerate(label_list)}
    model.config.id2label = {id: label for label, id in model.config.label2id.items()}

    padding = "max_length" if args.pad_to_max_length else False

    def preprocess_function(examples):
        texts = (examples[sentence1_key],) if sentence2_key is None else (examples[sentence1_key],
                                                                          examples[sentence2_key])
        result = tokenizer(*texts, padding=padding, max_length=args.max_length, truncation=True)
        if "label" in examples:
            if label_to_id is not None:
                result["labels"] = [label_to_id[label] for label in examples["label"]]
            else:
                result["labels"] = examples["label"]
        return result

    with accelerator.main_process_first():
        processed_datasets = raw_datasets.map(
            preprocess_function, batched=True, remove_columns=raw_datasets["train"].column_names
        )
    train_dataset = processed_datasets["train"]
    eval_dataset = processed_datasets["validation_matched" if args.task_name == "mnli" else "validation"]

    if args.pad_to_max_length:
        data_collator = default_data_collator
    else:  # multiples of 8 (16 for fp8) for tensor cores under mixed precision
        pad_to_multiple_of = {"fp8": 16, "no": None}.get(accelerator.mixed_precision, 8)
        data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)
    return model, tokenizer, train_dataloader, eval_dataloader


def optimizer_and_scheduler(args, model, train_dataloader):
    """The script's AdamW (no weight decay on biases and LayerNorm weights) and
    ``get_scheduler``, sized as the script sizes it (its lines 443-470)."""
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    # from the unprepared loader: with N processes the prepared scheduler steps N times per update
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.max_train_steps or args.num_train_epochs * num_update_steps_per_epoch,
    )
    return optimizer, lr_scheduler


# -- what replaces the script's lines 472-639 --------------------------------------


class BinaryF1:
    """The F1 score of label 1 (what ``evaluate.load("glue", "mrpc")`` adds to the
    accuracy), over every evaluation example once: counted in ``after_eval_step``,
    written in ``on_eval_end``."""

    name = "f1"

    @hookimpl
    def on_eval_start(self):
        self.counts = torch.zeros(3, dtype=torch.long)  # true positives, false positives, false negatives

    @hookimpl
    def after_eval_step(self, loop, batch, outputs):
        predictions, references = loop.accelerator.gather_for_metrics(
            (outputs.logits.argmax(dim=-1), batch["labels"]))
        self.counts += torch.stack([((predictions == 1) & (references == 1)).sum(),
                                    ((predictions == 1) & (references != 1)).sum(),
                                    ((predictions != 1) & (references == 1)).sum()]).cpu()

    @hookimpl
    def on_eval_end(self, metrics):
        tp, fp, fn = self.counts.tolist()
        metrics["eval_f1"] = 2 * tp / (2 * tp + fp + fn) if tp else 0.0


class EpochReport:
    """``logger.info(f"epoch {epoch}: {eval_metric}")``, once per job."""

    @hookimpl
    def on_epoch_end(self, loop, epoch, metrics):
        loop.print(f"epoch {epoch}: {metrics}")


def train(args, accelerator, model, optimizer, lr_scheduler, train_dataloader, eval_dataloader):
    """The training loop, checkpointing, resuming, tracking and evaluation."""
    plugins = [EpochReport()]
    if model.config.num_labels == 2:
        plugins.append(BinaryF1())
    if args.checkpointing_steps == "epoch":
        plugins.append(Checkpoint(keep_last=None))
    elif args.checkpointing_steps is not None:
        plugins.append(Checkpoint(every_steps=int(args.checkpointing_steps), every_epoch=False, keep_last=None))
    if args.with_tracking:
        plugins += [Logger(console=False, project_name="glue_no_trainer", config=vars(args)), TrainLoss()]
    loop = Loop(
        model=model, optimizer=optimizer, scheduler=lr_scheduler,
        train_data=train_dataloader, eval_data=eval_dataloader,
        plugins=plugins, accelerator=accelerator, resume_from=args.resume_from_checkpoint,
    )
    if args.max_train_steps is None:
        return loop, loop.fit(epochs=args.num_train_epochs)
    return loop, loop.fit(max_steps=args.max_train_steps)


def main(argv=None):
    """Train, evaluate, save; return the loop and the last evaluation's metrics."""
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=args.report_to if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()
    model, tokenizer, train_dataloader, eval_dataloader = build(args, accelerator)
    optimizer, lr_scheduler = optimizer_and_scheduler(args, model, train_dataloader)
    loop, eval_metric = train(args, accelerator, model, optimizer, lr_scheduler, train_dataloader, eval_dataloader)

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        loop.networks["model"].unwrapped.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump(eval_metric, f)
    return loop, eval_metric


if __name__ == "__main__":
    main()
