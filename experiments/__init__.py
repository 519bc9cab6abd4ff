"""Research experiments on top of the trainer (not part of the installed package).

Each experiment (``autolr``, ``table1``) is one command with cached, resumable runs and a ``--quick`` smoke
mode, and writes its tables and figures to ``results/`` through its ``*_report`` module. Every run is the
trainer's own ``train_and_evaluate``; ``records`` caches the runs as JSON records.
"""
