"""Timeshare: several local LLMs, one GPU, switched in place."""

__version__ = "0.1.0"
