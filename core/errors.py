"""Typed errors a user can meet. Each message is a sentence that says what to do."""

from __future__ import annotations


class TimeshareError(Exception):
    """Base of every error Timeshare shows to a user."""

    #: short machine-readable code (used by the API's error body and the CLI's exit status)
    code: str = "timeshare_error"


class ConfigError(TimeshareError):
    """The configuration is invalid. ``problems`` holds one field-path message per problem."""

    code = "invalid_config"

    def __init__(self, problems: list[str], path: str | None = None) -> None:
        self.problems = list(problems)
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(where + "; ".join(self.problems))


class ModelFileError(TimeshareError):
    """A model file is missing, truncated, not a GGUF, or changed on disk after it was loaded."""

    code = "model_file"


class UnknownModelError(TimeshareError):
    code = "model_not_found"


class ModelUnavailableError(TimeshareError):
    """The model exists but cannot serve now (failed, stopped, restarting)."""

    code = "model_unavailable"


class PromptTooLongError(TimeshareError):
    code = "context_length_exceeded"


class QueueFullError(TimeshareError):
    code = "queue_full"


class TokenTimeoutError(TimeshareError):
    """Waiting for the GPU token took longer than the configured timeout (e.g. another model is pinned)."""

    code = "gpu_busy"


class ArenaError(TimeshareError):
    """The arena directory is unsafe or unusable."""

    code = "arena"


class ResidencyError(TimeshareError):
    """Releasing or restoring a model's weights failed; the model stays released and intact."""

    code = "residency"


class OutOfDeviceMemoryError(ResidencyError):
    code = "out_of_device_memory"


class ProtocolError(TimeshareError):
    code = "protocol"


class CancelledError(TimeshareError):
    code = "cancelled"
