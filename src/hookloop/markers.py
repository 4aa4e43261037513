"""The two pluggy markers of the ``hookloop`` project.

Kept in their own module so that ``hookspecs.py``, the built-in plugins and
third-party plugins can import them without importing the loop.
"""

import pluggy

PROJECT_NAME = "hookloop"
ENTRY_POINT_GROUP = "hookloop"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
