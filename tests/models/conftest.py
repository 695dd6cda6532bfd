"""Fixtures of the whole-model tests; the helpers live in models_helpers.py (a unique module
name: several test folders have a conftest.py, and tests import helpers by name)."""

from models_helpers import tiny  # noqa: F401  (the session fixture)
