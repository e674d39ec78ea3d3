"""Typed errors. Library code raises these; only `moekit.cli` prints them and exits."""


class MoekitError(Exception):
    """Base class: one clear message, shown to the user as is."""


class ConfigError(MoekitError):
    """A config, spec or argument is invalid (raised before any work is done)."""


class UnsupportedModelError(MoekitError):
    """The model's architecture has no surgery adapter."""


class OutputExistsError(MoekitError):
    """The output directory exists and is not empty, and overwrite was not requested."""


class ExportError(MoekitError):
    """The MoE model cannot be represented in the requested native format."""


class CheckpointError(MoekitError):
    """A checkpoint is missing, malformed, or would need unsafe loading (pickle, remote code)."""


class AssetError(MoekitError):
    """A built-in asset could not be fetched or converted."""


class ToolError(MoekitError):
    """An external program (espeak-ng, flite, sox) is missing or failed."""
