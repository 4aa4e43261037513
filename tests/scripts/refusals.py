"""A refusal every rank raises, printed by every rank before any of them exits.

When a rank of ``accelerate launch`` exits with an error, the launcher's
agent SIGTERMs the others at its next look (every 0.1 s): a rank a moment
behind is killed before it prints its own error, and a test that asserts
that every rank refused (each printed the error) would pass or fail with
the scheduling of a busy machine. :func:`every_rank_prints_its_refusal`
prints the ``CheckpointError``, marks ``OUT/refused-<rank>``, waits for
every rank's mark (a deadline: a rank that never refuses fails the test
anyway), then exits 1; any other ending is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

from hookloop.checkpointing import CheckpointError

#: seconds a rank that refused waits for the others' refusals
PATIENCE_S = 60


@contextlib.contextmanager
def every_rank_prints_its_refusal(out: Path):
    try:
        yield
    except CheckpointError:
        traceback.print_exc()
        sys.stderr.flush()
        rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
        (Path(out) / f"refused-{rank}").touch()
        deadline = time.monotonic() + PATIENCE_S
        while len(list(Path(out).glob("refused-*"))) < world and time.monotonic() < deadline:
            time.sleep(0.01)
        raise SystemExit(1) from None
