"""The peers' loops on the benchmark's workloads (``workloads.py``): the same
seeded model, optimizer, scheduler and data, trained the way each library's
documentation shows, with the defaults a user gets; each does the
hand-written loop's arithmetic (forward, loss, backward, ``optimizer.step``,
``scheduler.step`` every update, ``zero_grad``), so that their parameters
come out bitwise equal to it.

``ignite``     PyTorch-Ignite: ``create_supervised_trainer`` (an ``Engine``), the
               scheduler stepped on ``Events.ITERATION_COMPLETED``; no Accelerate.
``ptacc``      pytorch-accelerated's ``Trainer`` (Accelerate underneath, callbacks
               around it): its default callbacks, the data as a dataset (it builds
               the loader: ``num_workers=0``, and the random state it re-seeds given
               back, to draw the same batches), the scheduler through
               ``create_scheduler_fn``.
``lightning``  Lightning's ``Trainer`` and a ``LightningModule``, the scheduler at
               ``interval="step"``; no logger, progress bar, model summary or
               checkpoint (none is asked of the others).

Each times its epochs with the library's own epoch events, as the others do.
"""

from __future__ import annotations

import torch

import workloads as W

PEERS = ("ignite", "ptacc", "lightning")
LABELS = {"ignite": "PyTorch-Ignite (create_supervised_trainer)",
          "ptacc": "pytorch-accelerated Trainer",
          "lightning": "Lightning Trainer"}
MODULES = {"ignite": "ignite.engine", "ptacc": "pytorch_accelerated", "lightning": "lightning.pytorch"}


def run(variant: str, work: W.Workload, clock: W.EpochClock, device: str):
    if work.name == "gan":
        raise ValueError("the peers' supervised trainers do not train a GAN")
    return {"ignite": run_ignite, "ptacc": run_ptacc, "lightning": run_lightning}[variant](work, clock, device)


def _loss_of_outputs(outputs, targets):
    return outputs.loss if targets is None else torch.nn.functional.cross_entropy(outputs, targets)


def _split(batch):
    """``(inputs, targets)``: a dict batch (BERT, labels inside) is the model's keyword arguments."""
    return (batch, None) if isinstance(batch, dict) else tuple(batch)


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def run_ignite(work: W.Workload, clock: W.EpochClock, device: str):
    from ignite.engine import Events, create_supervised_trainer
    from ignite.utils import convert_tensor

    model, = work.models.values()
    optimizer, = work.optimizers.values()
    scheduler, = work.schedulers.values()
    model.to(device)

    def prepare_batch(batch, device=None, non_blocking=False):
        inputs, targets = _split(batch)
        return (convert_tensor(inputs, device=device, non_blocking=non_blocking),
                None if targets is None else convert_tensor(targets, device=device, non_blocking=non_blocking))

    trainer = create_supervised_trainer(model, optimizer, _loss_of_outputs, device=device,
                                        prepare_batch=prepare_batch, model_fn=_call)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: scheduler.step())
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: clock.start())
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda engine: clock.stop())
    trainer.run(work.dataloader, max_epochs=work.epochs)
    return work.models


def run_ptacc(work: W.Workload, clock: W.EpochClock, device: str):
    from pytorch_accelerated import Trainer
    from pytorch_accelerated.callbacks import TrainerCallback

    model, = work.models.values()
    optimizer, = work.optimizers.values()
    scheduler, = work.schedulers.values()

    class Clock(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            clock.start()

        def on_train_epoch_end(self, trainer, **kwargs):
            clock.stop()

    class Supervised(Trainer):
        def _prepare_model_optimizer_and_dataloaders(self):
            # it re-seeds every run with set_seed(42): given back the run's own generator
            # state, it draws the others' batches (everything else is its own)
            state = torch.random.get_rng_state()
            super()._prepare_model_optimizer_and_dataloaders()
            torch.random.set_rng_state(state)

        def calculate_train_batch_loss(self, batch):
            inputs, targets = _split(batch)
            outputs = _call(self.model, inputs)
            return {"loss": _loss_of_outputs(outputs, targets), "model_outputs": outputs,
                    "batch_size": work.batch_size}

    from pytorch_accelerated.trainer import DEFAULT_CALLBACKS

    trainer = Supervised(model=model, loss_func=None, optimizer=optimizer, callbacks=(*DEFAULT_CALLBACKS, Clock))
    lambdas = scheduler.lr_lambdas
    trainer.train(train_dataset=work.dataloader.dataset, num_epochs=work.epochs,
                  per_device_batch_size=work.batch_size,
                  create_scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambdas[0]),
                  train_dataloader_kwargs={"num_workers": 0, "worker_init_fn": None, "shuffle": True})
    return {"model": trainer._accelerator.unwrap_model(trainer.model)}


def run_lightning(work: W.Workload, clock: W.EpochClock, device: str):
    import lightning.pytorch as pl

    model, = work.models.values()
    optimizer, = work.optimizers.values()
    scheduler, = work.schedulers.values()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            inputs, targets = _split(batch)
            return _loss_of_outputs(_call(self.model, inputs), targets)

        def configure_optimizers(self):
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_train_epoch_start(self):
            clock.start()

        def on_train_epoch_end(self):
            clock.stop()

    trainer = pl.Trainer(max_epochs=work.epochs, accelerator="gpu" if device.startswith("cuda") else "cpu",
                         devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(Module(), work.dataloader)
    return work.models
