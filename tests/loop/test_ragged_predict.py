"""loop.predict with outputs whose size differs per batch (per-token outputs of
batches padded to their own longest sequence): padded with -100 as the
Hugging Face Trainer pads them, the real values in place; what cannot be
joined is an error naming the output and the shapes."""

import pytest
import torch
from torch.utils.data import DataLoader

from hookloop import Loop
from hookloop.testing import reset_accelerate

VOCAB = 20


class Tagger(torch.nn.Module):
    """Per-token logits and the token ids, as a dict."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, input_ids):
        return {"logits": self.head(self.embed(input_ids)), "ids": input_ids,
                "first": self.head(self.embed(input_ids[:, 0]))}  # one row per example: never padded


def pad_batch(rows):
    """Each batch padded to its own longest sequence (0 is the padding token)."""
    longest = max(len(r) for r in rows)
    return {"input_ids": torch.stack([torch.cat([r, r.new_zeros(longest - len(r))]) for r in rows])}


def tagger_loop():
    reset_accelerate()
    torch.manual_seed(0)
    model = Tagger()
    rows = [torch.randint(1, VOCAB, (n,)) for n in (3, 5, 2, 7, 4, 6, 5, 2, 3, 4, 6)]
    return Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=DataLoader(rows, batch_size=4, collate_fn=pad_batch), block=["progress"]), rows


def test_per_token_outputs_of_ragged_batches_come_back_padded_with_minus_100():
    loop, rows = tagger_loop()
    data = DataLoader(rows, batch_size=4, collate_fn=pad_batch)  # batches 7, 6 and 6 tokens long
    out = loop.predict(data)
    model = loop.networks["model"].unwrapped
    model.eval()
    with torch.no_grad():  # the hand-written loop: one output per batch
        by_batch = [model(**batch) for batch in data]
    widest = max(b["logits"].shape[1] for b in by_batch)
    assert out["logits"].shape == (11, widest, 3) and out["ids"].shape == (11, widest)
    assert out["ids"].dtype == torch.int64 and out["first"].shape == (11, 3)
    expected_logits = torch.full((11, widest, 3), -100.0)
    expected_ids = torch.full((11, widest), -100)
    start = 0
    for b in by_batch:
        n, t = b["ids"].shape
        expected_logits[start:start + n, :t] = b["logits"]
        expected_ids[start:start + n, :t] = b["ids"]
        start += n
    assert torch.equal(out["logits"], expected_logits) and torch.equal(out["ids"], expected_ids)
    assert torch.equal(out["first"], torch.cat([b["first"] for b in by_batch]))
    assert (out["ids"] == -100).any()  # the shorter batches were padded
    # another padding value, as asked
    assert (loop.predict(data, pad_index=0)["ids"] == -100).sum() == 0


def test_ragged_outputs_without_padding_and_unjoinable_outputs_are_named():
    loop, rows = tagger_loop()
    data = DataLoader(rows, batch_size=4, collate_fn=pad_batch)
    with pytest.raises(ValueError, match=r"predict: outputs\['logits'\] cannot be joined: its batches differ in size "
                                         r"after the first dimension \(batch 0: \[4, 7, 3\] float32, batch 1: "
                                         r"\[4, 6, 3\] float32, batch 2: \[3, 6, 3\] float32\) and pad_index is None"):
        loop.predict(data, pad_index=None)

    class Squeezes(torch.nn.Module):  # a batch of one loses its batch dimension
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids)["logits"].squeeze(0)

    loop.networks["model"].model = Squeezes(loop.networks["model"].model)
    with pytest.raises(ValueError, match=r"predict: outputs cannot be joined: its batches have different numbers of "
                                         r"dimensions: batch 0: \[4, 7, 3\] float32, batch 1: \[4, 6, 3\] float32, "
                                         r"batch 2: \[1, 3\] float32"):
        loop.predict(DataLoader(rows[:9], batch_size=4, collate_fn=pad_batch))
