"""Commands that read what runs wrote, outside any run: `accel-trainer report` (report.py, the [report] extra:
matplotlib). The training loop (the package root) never imports this package (tests/test_architecture.py).
"""
