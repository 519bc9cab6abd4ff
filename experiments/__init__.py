"""Research experiments on top of the trainer (not part of the installed package).

Each module is one command with cached, resumable runs and a ``--quick`` smoke mode; each writes its
tables and figures to ``results/``. They call the trainer's own ``train_and_evaluate``.
"""
