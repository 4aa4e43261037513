"""What every packaged demo shares: where it writes, and the extra it needs.

Every demo writes under one folder, ``./hookloop-runs/<demo>`` (``<demo>`` as
typed after ``hookloop demo``: ``gan``, ``digits``, ``text``, ``distill``);
its ``--out`` option moves it. A demo whose packages are not installed stops
before any work with one line naming the extra to install, and exit status 2
(the status ``argparse`` gives a command line it cannot use).
"""

from __future__ import annotations

import importlib.util
import os
import sys

#: the folder every demo writes under, relative to the working directory
RUNS_DIR = "hookloop-runs"

#: import name -> distribution name, for the modules an extra brings
DISTRIBUTIONS = {
    "transformers": "transformers",
    "datasets": "datasets",
    "vaderSentiment": "vadersentiment",
    "sklearn": "scikit-learn",
    "scipy": "scipy",
    "PIL": "pillow",
}

#: demo -> (the extra that brings its packages, the modules it imports from them)
EXTRAS = {
    "gan": ("demo", ("sklearn", "scipy", "PIL")),
    "digits": ("demo", ("sklearn",)),
    # the MiniLM package only when it is the model: text_classification.minilm_path says so
    "text": ("text", ("transformers", "datasets", "vaderSentiment")),
    "distill": ("text", ("transformers", "datasets", "vaderSentiment")),
}


def default_out(demo: str) -> str:
    """``hookloop-runs/<demo>``: where ``hookloop demo <demo>`` writes."""
    return os.path.join(RUNS_DIR, demo)


def missing_modules(modules) -> list[str]:
    """The distributions of those ``modules`` that cannot be imported.

    ``find_spec`` looks without importing (``transformers`` alone takes
    seconds to import); a module set to ``None`` in ``sys.modules`` counts
    as missing, as ``import`` treats it."""
    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a broken entry
            found = False
        if not found:
            missing.append(DISTRIBUTIONS.get(module, module))
    return missing


def require_extra(demo: str) -> int | None:
    """``None`` when every module ``hookloop demo <demo>`` imports is
    installed; else print one line on stderr naming what is missing and the
    extra that brings it, and return 2 (the demo's exit status)."""
    if demo not in EXTRAS:  # a demo of its own packages only
        return None
    extra, modules = EXTRAS[demo]
    missing = missing_modules(modules)
    if not missing:
        return None
    if os.environ.get("RANK", "0") == "0":  # under `accelerate launch`: every rank stops, one says why
        print(f"hookloop demo {demo}: needs the {extra!r} extra ({', '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} not installed): "
              f'pip install "hookloop[{extra}]"', file=sys.stderr)
    return 2
