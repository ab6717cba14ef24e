"""Typed errors a user can meet. Each message is a sentence that says what to do.

Every TimeshareError lives here, each with its ``code`` (the pool maps a worker's error code back
to its class from this module). Exceptions that never leave their room (the API's 400 refusals,
the residency's in-place probes, the demo's missing package) stay in their module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


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


class DiskFullError(TimeshareError):
    """A write Timeshare needs failed, or would, for lack of disk space (ENOSPC, EDQUOT); ``path``
    is the file or folder. The message names what is full and where."""

    code = "disk_full"

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


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


class InvalidSamplingError(TimeshareError):
    """A request's sampling settings do not fit the model (e.g. a logit_bias token outside its
    vocabulary); the message says which. The API answers 400."""

    code = "invalid_sampling"


class InvalidInputError(TimeshareError):
    """A request's input does not fit the model (e.g. a token id outside its vocabulary in
    /v1/embeddings); the message says which input. The API answers 400."""

    code = "invalid_input"


class InvalidGrammarError(InvalidSamplingError):
    """A request's grammar (GBNF, a JSON schema's, a trigger pattern) cannot be used; the message
    says which part. The API answers 400."""

    code = "invalid_grammar"


class ChatTemplateError(TimeshareError):
    """The model's chat template refused the messages (it raised, e.g. roles that do not alternate)."""

    code = "chat_template"


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


class InternalError(TimeshareError):
    """A worker failed in a way it did not expect (a bug, or a library's own error); see its log."""

    code = "internal"


class FrameError(ProtocolError):
    """A pool↔worker frame could not be decoded.

    ``recoverable``: the frame boundary was intact (bad JSON, unknown type, invalid field), so the
    stream can continue after an ``Error`` reply; otherwise the connection must be dropped.
    ``req``: the request id found in the bad frame, if any, so the reply can echo it.
    """

    def __init__(self, message: str, *, recoverable: bool, req: str | None = None) -> None:
        super().__init__(message)
        self.recoverable = recoverable
        self.req = req


class UnsafeArenaError(ArenaError):
    """The arena directory cannot be trusted (owner, mode, symlink) or used (not a directory)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"refusing the arena directory {path}: {reason}. Use a directory only you own and only you "
            f"can write (chmod 700), or point TIMESHARE_VRAM_ARENA or arena.dir in the config elsewhere."
        )


class ModelFileChangedError(ModelFileError, ResidencyError):
    """The model file changed on disk after loading; restoring from it is refused (the model stays
    released). Both a ModelFileError and a ResidencyError."""

    code = "model_file_changed"


class ApiBindError(TimeshareError):
    """The API could not listen on the configured address."""

    code = "api_bind"


class UntrustedAddressError(TimeshareError):
    """The API address file, or the runtime dir that holds it, is not the user's own (another
    owner, group- or world-writable, a symbolic link): the CLI does not use the address it names,
    so it never sends the API key to a planted one."""

    code = "untrusted_address"


class InstanceRunningError(TimeshareError):
    """Another Timeshare already runs for this runtime dir (core/instance.py): ``kind`` ("serve",
    "tray" or ""), ``pid`` and ``url`` (its API, None when none is recorded) say which."""

    code = "instance_running"

    def __init__(
        self, message: str, *, kind: str = "", pid: int | None = None, url: str | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.pid = pid
        self.url = url


# ---- conversations (core/conversations/) --------------------------------------------------


class StoreError(TimeshareError):
    """The conversation database cannot be opened or used."""

    code = "store"


class UnknownConversationError(TimeshareError):
    code = "conversation_not_found"


class UnknownMessageError(TimeshareError):
    code = "message_not_found"


class EmptyMessageError(TimeshareError):
    code = "invalid_request"


class InvalidTextError(TimeshareError):
    """Text that is not Unicode (a lone surrogate, from a broken paste or input method) cannot be
    saved or sent; the message says where it is."""

    code = "invalid_string"


class ConversationBusyError(TimeshareError):
    """An answer is still being generated in this conversation."""

    code = "conversation_busy"


# ---- getting models (core/pull/) ------------------------------------------------------------------


class DownloadError(TimeshareError):
    """Getting a model failed: the network, the server, or what it sent."""

    code = "download_failed"


class RemoteNotFoundError(DownloadError):
    """The repository, file, quantisation or URL does not exist."""

    code = "remote_not_found"


class RemoteAccessError(DownloadError):
    """The server refused access: a gated or private repository without a valid token, HTTP 401/403."""

    code = "remote_access_denied"


class ChooseQuantisationError(DownloadError):
    """A repository holds several quantisations and none was chosen; ``choices`` names them."""

    code = "choose_quantisation"

    def __init__(self, message: str, choices: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.choices = choices


class NoSpaceError(DownloadError):
    """The disk the model goes to has no room for it; what was downloaded is kept only when the
    download can resume (the server said the size and honours Range), else deleted."""

    code = "no_space"


class UnsafeNameError(DownloadError):
    """A name from a remote (an ETag, a commit, a file name) is not a safe path component, or a
    path would lead outside its folder: refused before anything is written."""

    code = "unsafe_remote_name"


class DownloadTooLargeError(DownloadError):
    """A download of unknown size went past the cap (``timeshare pull --max-size``), or a server
    sent more bytes than it announced; the partial file was deleted."""

    code = "download_too_large"


class CorruptDownloadError(DownloadError):
    """The downloaded file is not what the server announced (size, sha256) or not a whole GGUF."""

    code = "corrupt_download"


class UnsupportedArchitectureError(ModelFileError):
    """The GGUF's ``general.architecture`` is not one the installed llama.cpp can load."""

    code = "unsupported_architecture"


class VramBudgetError(TimeshareError):
    """A model's weights do not fit the device's VRAM budget: larger than the whole budget, or
    only pinned models hold the rest (the message names the numbers and the pinned models)."""

    code = "vram_budget"
