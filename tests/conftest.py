import os

import pytest

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
