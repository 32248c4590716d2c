"""Exceptions for bad input at the edges of the optimized stack.

Everything raised for bad user input derives from K3Error, so a CLI can turn it
into a one-line message and exit code 2 without catching real bugs.
"""


class K3Error(ValueError):
    """Bad input: a config, checkpoint, preset name or argument that cannot be used."""


class ConfigError(K3Error):
    """A config.json field is missing, unknown or out of range."""


class CheckpointError(K3Error):
    """A checkpoint tensor is missing, unexpected or mis-shaped."""
