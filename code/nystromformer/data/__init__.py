"""Data preprocessing: raw corpora -> plain-text partitions -> token shards.

Stages (each a ``nystromformer`` subcommand, see ``commands.py`` and docs/data.md):
``extract-wiki`` (wiki.py), ``preprocess`` (readers.py + partitions.py), ``train-tokenizer`` (tokenize.py),
``build-shards`` (build.py).
"""
