"""The text-classification example in two processes, launched by
tests/test_text_classification.py with

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 \\
        text_two_processes.py REPORT.json --cpu --model DIR ...

Everything after REPORT.json goes to the example's own command line. The
example runs unchanged, plus one plugin that wraps ``after_eval_step`` to keep what
the evaluation gathered. The main process writes REPORT.json: how many
processes there were, whether both ranks ended with the same parameters, and
what each evaluation counted, next to a one-process evaluation of the same
final model on the whole test set.
"""

import gc
import json
import sys

import torch

from hookloop import hookimpl
from hookloop.examples import text_classification as tc


class GatheredEval:
    """Keep the per-example values each evaluation gathered, as the loop got them."""

    name = "gathered-eval"

    def __init__(self):
        self.runs = []

    @hookimpl
    def on_eval_start(self, loop):
        if loop.state.stage == "eval":  # not the sanity check (stage "sanity")
            self.runs.append({"eval_loss": [], "eval_accuracy": []})

    @hookimpl(wrapper=True)
    def after_eval_step(self, loop):
        results = yield  # what every metric plugin returned: the defaults' per-example values
        if loop.state.stage == "eval":  # not the sanity check's batch
            values = next(r for r in results if "eval_loss" in r)
            for key, run in self.runs[-1].items():
                run.extend(values[key].tolist())
        return results


def reference_eval(model, tokenizer, args):
    """Per-example loss and correctness of ``model`` on the whole test set, in
    one process, without Accelerate: what the sharded evaluation must match."""
    data = tc.load_data(tokenizer, args)
    _, test = tc.make_dataloaders(data, tokenizer, args.batch_size)
    model.eval()
    losses, correct = [], []
    with torch.no_grad():
        for batch in test:
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            losses += torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none").tolist()
            correct += (logits.argmax(-1) == batch["labels"]).float().tolist()
    return losses, correct


def main():
    report_path, argv = sys.argv[1], sys.argv[2:]
    args = tc.parse_args(argv)
    recorder = GatheredEval()
    result = tc.run(args, plugins=[recorder])
    loop = result.loop
    accelerator = loop.accelerator
    model = loop.networks["model"].unwrapped
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = accelerator.gather(flat.unsqueeze(0))  # one row per process
    ranks = accelerator.gather(torch.tensor([accelerator.process_index]))
    if accelerator.is_main_process:
        tokenizer, _ = tc.load_model(result.model_ref)
        ref_loss, ref_correct = reference_eval(model, tokenizer, args)
        last = recorder.runs[-1]
        report = {
            "num_processes": accelerator.num_processes,
            "process_indices": ranks.tolist(),
            "same_parameters": bool(torch.equal(both[0], both[-1])),
            "rows_gathered": both.shape[0],
            "eval_counts": [len(run["eval_loss"]) for run in recorder.runs],
            "num_test": result.num_test,
            "gathered_losses": sorted(last["eval_loss"]),
            "reference_losses": sorted(ref_loss),
            "gathered_correct": sum(last["eval_accuracy"]),
            "reference_correct": sum(ref_correct),
            "eval_accuracy": result.metrics["eval_accuracy"],
            "global_step": loop.state.global_step,
            "log_path": result.log_path,
        }
        with open(report_path, "w", encoding="utf-8") as f:
            json.dump(report, f)
    # drop the DDP-wrapped objects before the interpreter exits (gloo can abort otherwise)
    loop.close()
    del loop, result, model
    gc.collect()


if __name__ == "__main__":
    main()
