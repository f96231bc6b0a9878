"""One exception type per family of failure.

Every message should say what was expected, what was found, and what to do about it.
"""


class Eagle3Error(Exception):
    """Base class for errors raised by eagle3_jax."""


class ConfigError(Eagle3Error, ValueError):
    """A configuration value is missing, malformed, or inconsistent with another."""


class CheckpointError(Eagle3Error, ValueError):
    """A checkpoint on disk does not match what its config (or our layout) requires."""


class SettingsError(ConfigError):
    """A bad command line or settings file (unknown key, wrong type, out-of-range value): the
    command-line tools exit with ``exit_code`` 2 for these and 1 for a run that failed."""

    exit_code = 2
