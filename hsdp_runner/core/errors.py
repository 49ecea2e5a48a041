"""The errors a user can cause: each message names the config key (or path), the value and a fix."""


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the key, the value and a fix."""
