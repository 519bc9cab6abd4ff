"""The research behind hdet-jax's defaults (not part of the installed package; research/README.md).

Each study (``autolr``, ``workloads``, ``table1``, the bracket studies, ...) is one command with cached, resumable
runs and a ``--quick`` smoke mode, and writes its tables and figures to ``results/``. Every run is the trainer's own
``train_and_evaluate``; ``records`` caches the runs as JSON records. The research imports the product; the product
(``hdet_jax``, ``configs``, ``train.py``, ``tests``) never imports the research.
"""
