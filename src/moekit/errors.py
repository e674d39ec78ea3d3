"""Typed errors. Library code raises these; only `moekit.cli` prints them and exits.

Messages are worded for the library's caller: a remedy is the keyword argument that grants it
(`allow_pickle=True`, `overwrite=True`); the command line rewords those as its flags (`--allow-pickle`).
"""


class MoekitError(Exception):
    """Base class: one clear message, shown to the user as is (remedies in the library's words)."""


class ConfigError(MoekitError):
    """A config, spec or argument is invalid (raised before any work is done)."""


class UnsupportedModelError(MoekitError):
    """The model's architecture has no surgery adapter."""


class OutputError(MoekitError):
    """An output cannot be written safely (checked before any work where possible)."""


class OutputExistsError(OutputError):
    """The output exists (a non-empty directory, or a file) and overwrite was not requested."""

    def __init__(self, path, message: str):
        self.path = path
        super().__init__(f"{message}; pass overwrite=True to replace it")


class UnsafeOutputError(OutputError):
    """The output would replace or contain an input or the working directory, or is a symbolic link."""


class OutputBusyError(OutputError):
    """Another process holds the output's lock."""


class WriteError(OutputError):
    """Writing failed or cannot succeed: disk full, file too large, permission denied, read-only."""


class NumericsError(MoekitError):
    """Weights are not finite (NaN or Inf)."""


class ExportError(MoekitError):
    """The MoE model cannot be represented in the requested native format."""


class CheckpointError(MoekitError):
    """A checkpoint is missing, malformed, or would need unsafe loading (pickle, remote code)."""


class AssetError(MoekitError):
    """A built-in asset could not be fetched or converted."""


class ToolError(MoekitError):
    """An external program (espeak-ng, flite, sox) is missing or failed."""


class ResourceError(MoekitError):
    """The work needs more memory than the machine has (checked before it starts)."""
