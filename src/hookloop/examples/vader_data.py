"""A real, human-labelled text data set that works offline: the VADER lexicon.

The PyPI package ``vadersentiment`` ships ``vader_lexicon.txt``: 7,520 words,
slang and emoticons, each rated by ten people from -4 (most negative) to +4
(most positive). One line per entry, tab-separated::

    token  mean-valence  standard-deviation  [ten ratings]

:func:`load_vader` reads it with ``datasets`` (``load_dataset("csv", ...)``),
labels each token positive (1) when the mean rating is above zero and negative
(0) below it, and splits train/test with a fixed seed. The lexicon has no
zero means (entries rated neutral were left out by its authors); any would be
dropped. Fourteen tokens appear twice (``lol``, ``ok``, ``xd``...); only the
first line of each is kept, so that no token is in both train and test.
About 44.5 % of the entries are positive: a model must beat 55.5 % (always
"negative") to have learnt anything.
"""

from __future__ import annotations

import csv
import os

#: the columns of ``vader_lexicon.txt``, in order
COLUMNS = ["text", "mean", "std", "ratings"]


def lexicon_path() -> str:
    """Where the installed ``vadersentiment`` package keeps its lexicon."""
    try:
        import vaderSentiment
    except ImportError as exc:  # pragma: no cover - an install problem
        raise ImportError(
            "the text example needs the VADER lexicon: pip install vadersentiment "
            "(or pip install 'hookloop[text]')"
        ) from exc
    return os.path.join(os.path.dirname(vaderSentiment.__file__), "vader_lexicon.txt")


def load_vader(test_size: float = 0.2, seed: int = 0, path: str | None = None, cache_dir=None):
    """The lexicon as a ``datasets.DatasetDict`` with ``train`` and ``test``
    splits; each row has ``text`` (the token), ``label`` (1 positive, 0
    negative) and ``mean`` (the average rating).

    :param test_size: fraction held out for evaluation.
    :param seed: the split's seed (the same seed gives the same split).
    :param path: another file in the same format (default: the packaged one).
    :param cache_dir: ``datasets`` cache (default: ``HF_DATASETS_CACHE``).
    """
    from datasets import Features, Value, load_dataset

    features = Features({
        "text": Value("string"), "mean": Value("float64"),
        "std": Value("float64"), "ratings": Value("string"),
    })
    raw = load_dataset(
        "csv",
        data_files=path or lexicon_path(),
        split="train",
        cache_dir=cache_dir,
        sep="\t",
        header=None,
        names=COLUMNS,
        features=features,
        # tokens are raw text: "true" and emoticons with quotes must stay strings
        quoting=csv.QUOTE_NONE,
        keep_default_na=False,
        na_filter=False,
    )
    raw = raw.select(_first_occurrences(raw["text"]))
    raw = raw.filter(lambda mean: mean != 0.0, input_columns="mean")
    data = raw.map(
        lambda mean: {"label": int(mean > 0)},
        input_columns="mean",
        remove_columns=["std", "ratings"],
    )
    return data.train_test_split(test_size=test_size, seed=seed)


def _first_occurrences(tokens) -> list[int]:
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        seen.setdefault(token, i)
    return sorted(seen.values())
