"""Count the lines of code of a Python file, as docs/migrating.md counts them.

A line of code holds a token of a statement: blank lines, lines holding only a
comment and the lines of docstrings do not count (a statement split over five
lines counts five: the files compared are formatted alike, at most 120
columns). ``FIRST-LAST`` (1-based, inclusive) counts part of the file::

    python docs/count_lines.py run_glue_no_trainer.py            # the whole file
    python docs/count_lines.py run_glue_no_trainer.py 443-639    # a part of it
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize

_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENCODING, tokenize.ENDMARKER}


def docstring_lines(source: str) -> set[int]:
    """The line numbers of every module, class and function docstring."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str, first: int = 1, last: int | None = None) -> int:
    """How many lines of ``source`` between ``first`` and ``last`` hold code."""
    skip = docstring_lines(source)
    holding = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            holding.update(range(token.start[0], token.end[0] + 1))
    last = source.count("\n") + 1 if last is None else last
    return len({n for n in holding - skip if first <= n <= last})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        source = f.read()
    first, last = (1, None) if len(argv) == 1 else map(int, argv[1].split("-"))
    print(code_lines(source, first, last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
