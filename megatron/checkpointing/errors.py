"""The errors of the checkpoint formats; each message names the file, flag or tensor."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


class ConversionError(CheckpointError):
    """Bad input to the converter; the message names the file, flag or tensor."""
