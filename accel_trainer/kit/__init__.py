"""Helpers for recipes, not part of the loop: offline-aware loading of transformers models, tokenizers and datasets
(text.py, hub.py) and metrics with evaluate's interface that work without the network (metrics.py,
metric_modules.py).

    from accel_trainer.kit.text import load_pretrained, tokenizer_for
    from accel_trainer import load_metric            # = accel_trainer.kit.metrics.load_metric

The training loop (the package root) never imports them (tests/test_architecture.py); the package's `__init__`
re-exports `load_metric` only, which imports nothing heavy until called.
"""
