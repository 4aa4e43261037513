"""A fingerprint of a function's code: how the guards around dependencies'
private code (:mod:`hookloop.accelerate_fastpath`, :mod:`hookloop._pluggy`)
tell the code they were checked against from any other."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap


@functools.lru_cache(maxsize=None)
def fingerprint(func) -> str:
    """A hash of a function's code with comments, docstrings and layout
    removed: it changes when what the function does may have changed.
    Raises ``OSError`` / ``TypeError`` when there is no source to read."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]
