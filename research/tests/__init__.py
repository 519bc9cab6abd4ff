"""The research's tests (``python -m pytest -q -n 2 --dist loadfile research/tests``), apart from the product's."""
