"""Configuration: models and settings, TOML in platformdirs' config dir.

The dataclasses below are the contract every layer codes against. Loading, validation with
field-path errors, atomic writes and defaults live here too.
"""
