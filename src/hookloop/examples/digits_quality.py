"""How good are generated 8x8 digits? A judge trained on the real ones says.

The GAN demo's quality measure, in the spirit of FID (Heusel et al., 2017)
with a judge that fits the data: a small classifier trained in a second or
two on scikit-learn's real ``load_digits``. On a batch of generated digits it
reports

- **coverage**: how many of the 10 digits the judge recognises (probability
  >= 0.9) in at least 2% of the samples (a fifth of a fair share) — a
  generator that collapsed onto a few digits, or draws blobs that are no
  digit, covers few;
- **Fréchet distance** between the real and the generated digits in the
  judge's feature space (its last hidden layer): the distance between two
  Gaussians fitted to the features, 0 for identical statistics.

A distance alone means little, so :func:`quality` is meant to be read next
to the same numbers for an untrained generator (what training started from)
and for two halves of the real digits (the floor sampling noise sets).

    judge = DigitJudge()
    print(judge.quality(samples))   # samples: (n, 64) tensor in [-1, 1]
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import linalg

#: a digit is covered when at least this share of the samples is recognisably it
MIN_SHARE = 0.02
#: a sample is recognisably a digit when the judge gives it this probability
CONFIDENCE = 0.9


def load_real_digits():
    """scikit-learn's 1,797 real digits as ``(images, labels)``: images a
    float tensor ``(1797, 64)`` scaled from 0..16 to -1..1, labels 0..9."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 8.0 - 1.0
    return images, torch.tensor(digits.target, dtype=torch.long)


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets
    ``(n, d)``: ``|mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2))``.

    ``tr((S_a S_b)^(1/2))`` is computed as the sum of the square roots of the
    eigenvalues of ``S_a^(1/2) S_b S_a^(1/2)`` (symmetric, so ``eigh``):
    exact, and stable where ``sqrtm(S_a @ S_b)`` warns about singular
    covariances (dead ReLU features have zero variance)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = linalg.eigh(cov_a)
    sqrt_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    tr_covmean = np.sqrt(np.clip(linalg.eigvalsh(sqrt_a @ cov_b @ sqrt_a), 0, None)).sum()
    diff = mu_a - mu_b
    return float(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2 * tr_covmean)


class DigitJudge:
    """A small MLP digit classifier trained on real digits; seeded, and
    trained inside ``torch.random.fork_rng`` so it leaves the caller's random
    state alone.

    :param seed: seeds the split, the initialisation and the training.
    :param steps: full-batch Adam steps (well under a second on one core).
    """

    def __init__(self, seed=0, steps=150, hidden=(128, 64)):
        images, labels = load_real_digits()
        self.real = images
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            order = torch.randperm(len(images))
            held = order[: len(images) // 5]
            train = order[len(images) // 5 :]
            self.body = torch.nn.Sequential(
                torch.nn.Linear(64, hidden[0]), torch.nn.ReLU(),
                torch.nn.Linear(hidden[0], hidden[1]), torch.nn.ReLU(),
            )
            self.head = torch.nn.Linear(hidden[1], 10)
            model = torch.nn.Sequential(self.body, self.head)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
            x, y = images[train], labels[train]
            for _ in range(steps):
                noisy = x + 0.1 * torch.randn_like(x)  # a little robustness to imperfect strokes
                loss = torch.nn.functional.cross_entropy(model(noisy), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            #: accuracy on the fifth of the real digits it did not train on
            self.accuracy = (model(images[held]).argmax(1) == labels[held]).float().mean().item()
        self._real_features = self.features(images)
        half = len(images) // 2
        #: Fréchet distance between two halves of the real digits: the floor
        self.real_floor = frechet_distance(
            self._real_features[order[:half].numpy()], self._real_features[order[half:].numpy()]
        )

    def features(self, x: torch.Tensor) -> np.ndarray:
        """The last hidden layer's activations, ``(n, hidden[1])``."""
        with torch.no_grad():
            return self.body(x.reshape(len(x), 64).float()).numpy().astype(np.float64)

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """The judge's class probabilities, ``(n, 10)``."""
        with torch.no_grad():
            return self.head(self.body(x.reshape(len(x), 64).float())).softmax(1)

    def quality(self, samples: torch.Tensor, min_share: float = MIN_SHARE,
                confidence: float = CONFIDENCE) -> dict:
        """The quality of generated digits ``(n, 64)`` (or ``(n, 8, 8)``) in [-1, 1]:

        ``frechet``: the Fréchet distance to the real digits' features;
        ``recognisable``: the share of samples the judge classifies with
        probability >= ``confidence``; ``shares``: per digit, the share of all
        samples recognisably that digit; ``coverage``: how many digits have a
        share >= ``min_share``.
        """
        samples = samples.detach().cpu().reshape(len(samples), 64)
        best, digit = self.probabilities(samples).max(1)
        sure = best >= confidence
        shares = torch.bincount(digit[sure], minlength=10).float() / len(samples)
        return {
            "frechet": max(0.0, frechet_distance(self._real_features, self.features(samples))),
            "coverage": int((shares >= min_share).sum()),
            "recognisable": round(sure.float().mean().item(), 4),
            "shares": [round(s, 4) for s in shares.tolist()],
        }
