"""The version of hookloop, in a module of its own: code inside the package
takes it from here, never from the package ``__init__`` (which imports the
loop, and so everything else)."""

__version__ = "0.5.0.dev0"
