"""Where things are, for tests in any folder of tests/ (conftest.py puts
tests/ and tests/scripts/ on sys.path)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPTS = TESTS / "scripts"
