"""The README's plugin-writing guide runs as written."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def guide_blocks():
    text = README.read_text()
    section = text.split("## Write your first plugin", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_plugin_guide_runs_and_does_what_it_says(capsys):
    blocks = guide_blocks()
    assert len(blocks) == 2
    namespace = {}
    exec(compile(blocks[0], "README:first-plugin", "exec"), namespace)
    loop = namespace["loop"]
    assert loop.state.stop_reason is not None and loop.state.stop_reason.startswith("loss ")
    assert loop.state.global_step % 10 == 0 and loop.state.epoch < 50
    out = capsys.readouterr().out
    assert "step 10 loss" in out and "stopped: loss" in out

    from hookloop.testing import reset_accelerate

    reset_accelerate()
    exec(compile(blocks[1], "README:loss-plugin", "exec"), namespace)
    assert namespace["loop"].state.global_step == 16
    assert "LabelSmoothing" in namespace["loop"].plugins.names()
