"""Timeshare."""
