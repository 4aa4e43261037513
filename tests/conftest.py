import os
import sys
from pathlib import Path

import pytest

# tests/ (paths.py, handwritten.py) and tests/scripts/ (the multi-process
# scripts' shared modules) import from any folder of tests/
_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# No test may reach a model hub, nor pick up a plugin installed on the machine.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    from hookloop.testing import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()
