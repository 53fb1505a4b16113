"""Runnable pipelines: `python -m pipelines.generate --help`."""
