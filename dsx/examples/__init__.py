"""Runnable jobs behind ``examples/`` (``python -m dsx.examples.gpt``)."""
