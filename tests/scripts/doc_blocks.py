"""The Python blocks of a Markdown page, and running them as written.

A page's blocks run in order in one namespace (a later block may use what an
earlier one defined), after docs/example_names.py (the names the docs use for
"your model, your data"). A block marked by a line right above its fence is
only compiled here:

``<!-- fragment: why -->``
    it cannot run as written (it needs the model hub, a GPU, or it is an
    excerpt of a larger program);
``<!-- runs in: TEST (why) -->``
    it runs as written in TEST, a slow test (a Ray cluster, a lighthouse and
    replica groups), relative to the page's folder or to the repository.

tests/docs/test_doc_blocks.py runs README.md's and docs/*.md's blocks in its
own process; tests/manager/test_plugin_distributions.py runs the plugins'
READMEs with this script, in a virtual environment where the plugins are
installed:

    python doc_blocks.py PAGE       # in a scratch directory: prints the number of blocks run
"""

import re
import runpy
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_NAMES = ROOT / "docs" / "example_names.py"
BLOCK = re.compile(r"(<!-- (fragment|runs in): ([^>]*)-->\n)?```python\n(.*?)```", flags=re.S)


class Block(NamedTuple):
    line: int  #: of the block's opening fence
    code: str
    marker: str | None  #: "fragment", "runs in" or None (it runs here)
    reason: str  #: what the marker says


def blocks(page: Path) -> list[Block]:
    """Every Python block of ``page``."""
    text = page.read_text()
    return [Block(text[:m.start()].count("\n") + 1 + bool(m.group(1)), m.group(4), m.group(2),
                  (m.group(3) or "").strip())
            for m in BLOCK.finditer(text)]


def run_page(page: Path, name: str | None = None) -> int:
    """Run ``page``'s blocks as written (in the working directory), a
    marked one only compiled; return how many ran."""
    name = name or page.name
    namespace = runpy.run_path(str(EXAMPLE_NAMES))
    ran = 0
    for block in blocks(page):
        compiled = compile(block.code, f"{name}:{block.line}", "exec")  # a marked block must still be Python
        if block.marker is None:
            exec(compiled, namespace)
            ran += 1
    return ran


if __name__ == "__main__":
    page = Path(sys.argv[1]).resolve()
    print(run_page(page, page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else None))
