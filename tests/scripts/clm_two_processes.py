"""A causal language model, as ``run_clm_no_trainer.py`` trains and evaluates
it, and its hookloop port, in the same processes (tests/loop/test_clm.py):

    accelerate launch --multi_gpu --num_processes 2 clm_two_processes.py OUT

GPT-2 from a config, AdamW and a linear schedule, gradient accumulation 2,
an evaluation after every epoch that gathers the loss repeated once per
example with ``gather_for_metrics`` (9 evaluation blocks, 2 per process and
batch: the last batch leaves one example, on one rank). The port writes
``perplexity`` in its own plugin, as the ported script did in 0.2. The main
process writes OUT/clm.json: the number of processes, whether the parameters of
the two runs are equal bit for bit, and each run's evaluations.
"""

import gc
import json
import math
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

from hookloop import Loop, hookimpl

EPOCHS, ACCUMULATION, BATCH = 2, 2, 2


def data():
    """Blocks of 16 tokens (``group_texts``), labels = inputs."""
    g = torch.Generator().manual_seed(0)
    train = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 96, (26, 16), generator=g)]
    evals = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 96, (9, 16), generator=g)]
    return train, evals


def build():
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0)
    train, evals = data()
    train_loader = DataLoader(train, shuffle=True, batch_size=BATCH, generator=torch.Generator().manual_seed(1))
    eval_loader = DataLoader(evals, batch_size=BATCH)
    steps = EPOCHS * math.ceil(len(train_loader) / ACCUMULATION)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=steps)
    return model, optimizer, train_loader, eval_loader, scheduler


def script():
    """``run_clm_no_trainer.py``'s loop."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model, optimizer, train_loader, eval_loader, scheduler = build()
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    evals = []
    for _ in range(EPOCHS):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                outputs = model(**batch)
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(BATCH)))
        losses = torch.cat(losses)
        eval_loss = torch.mean(losses)
        evals.append({"values": losses.tolist(), "eval_loss": eval_loss.item(),
                      "perplexity": math.exp(eval_loss)})
    params = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    processes = accelerator.num_processes
    del model, optimizer, train_loader, eval_loader, scheduler
    accelerator.free_memory()
    gc.collect()
    return params, evals, processes


class Perplexity:
    """The port's own perplexity, as 0.2 code wrote it (the built-in gives way)."""

    name = "clm-perplexity"

    def __init__(self):
        self.values = []

    @hookimpl(wrapper=True)
    def after_eval_step(self, loop):
        results = yield  # the built-in metrics' per-example values, as the loop got them
        if loop.state.stage == "eval":
            self.values.extend(next(r for r in results if "eval_loss" in r)["eval_loss"].tolist())
        return results

    @hookimpl
    def on_eval_end(self, metrics):
        metrics["perplexity"] = math.exp(metrics["eval_loss"])


class Evals:
    name = "evals"

    def __init__(self, seen):
        self.seen, self.runs = seen, []

    @hookimpl
    def on_epoch_end(self, metrics):
        self.runs.append({"values": self.seen.values, "eval_loss": metrics["eval_loss"],
                          "perplexity": metrics["perplexity"]})
        self.seen.values = []


def port():
    """The same run as a Loop."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model, optimizer, train_loader, eval_loader, scheduler = build()
    seen = Perplexity()
    evals = Evals(seen)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=train_loader,
                eval_data=eval_loader, accelerator=accelerator, plugins=[seen, evals], block=["progress"])
    loop.fit(epochs=EPOCHS, sanity_check=False)
    params = {k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()}
    loop.close()
    return params, evals.runs


def main():
    out = f"{sys.argv[1]}/clm.json"
    reference, script_evals, processes = script()
    params, port_evals = port()
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"processes": processes, "equal": all(torch.equal(reference[k], params[k]) for k in params),
                       "script": script_evals, "port": port_evals}, f)


if __name__ == "__main__":
    main()
