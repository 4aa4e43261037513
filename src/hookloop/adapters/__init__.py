"""Adapters: other libraries' extension points, driven by hookloop's hooks.

Each module imports its library only when used, so ``import hookloop`` never
needs them:

- :mod:`hookloop.adapters.transformers`: :class:`TrainerCallbacks`, Hugging
  Face ``transformers.TrainerCallback`` objects run unchanged (``pip install
  hookloop[hf]``).
"""
