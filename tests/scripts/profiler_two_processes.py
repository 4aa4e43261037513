"""Run by tests/plugins/test_profiler.py under `accelerate launch --multi_gpu
--num_processes 2` on CPU: every rank profiles the same window and writes its
own trace (``rank<N>``); the main process alone prints the table."""

import json
import sys
from pathlib import Path

from accelerate import Accelerator

from hookloop.plugins import Profiler
from hookloop.testing import tiny_loop

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2
loop = tiny_loop([Profiler(dir=out / "prof")], accelerator=accelerator)
loop.fit(epochs=2)  # 4 updates an epoch on each rank
ranks = accelerator.gather_for_metrics([accelerator.process_index], use_gather_object=True)
if accelerator.is_main_process:
    (out / "ranks.json").write_text(json.dumps(sorted(ranks)))
loop.close()
