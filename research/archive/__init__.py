"""The archived studies: each answered a settled question and no published page reads its records (research/README.md,
"Archived"). Their code, pages and records are kept: ``python -m research.archive.<study> --report-only`` redraws a
page byte for byte from its records (research/tests/test_reports_regenerate.py checks each in CI); their own tests,
under research/archive/tests/, are out of CI (run them by hand). An archived study may import the live ones; a live
one never imports the archive.
"""
