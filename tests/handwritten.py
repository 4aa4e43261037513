"""The reference workload's hand-written Accelerate loop, the reference hookloop must equal."""

import torch.nn.functional as F


def train_by_hand(accelerator, model, optimizer, dataloader, scheduler, epochs, loss_fn=None):
    """prepare, then per batch: forward, loss, backward, optimizer.step(),
    scheduler.step(), optimizer.zero_grad() — inside accumulate() when
    gradient accumulation is on, as Accelerate's examples do."""
    model, optimizer, dataloader, scheduler = accelerator.prepare(
        model, optimizer, dataloader, scheduler
    )
    for _ in range(epochs):
        model.train()
        for batch in dataloader:
            with accelerator.accumulate(model):
                if isinstance(batch, dict):
                    loss = model(**batch).loss
                else:
                    inputs, targets = batch
                    loss = (loss_fn or F.cross_entropy)(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return accelerator.unwrap_model(model)
