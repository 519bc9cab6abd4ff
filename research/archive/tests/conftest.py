"""The archived studies' tests run as the live ones do, by hand (out of CI: research/README.md): the same setup,
research/tests/conftest.py's (8 simulated CPU devices, one XLA compilation cache per process, the slowest files
first, each test building its runs' programs itself)."""

from research.tests.conftest import _own_programs, pytest_collection_modifyitems  # noqa: F401
