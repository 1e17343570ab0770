"""The configuration error type, apart from the loader and validation so neither imports the other."""


class ConfigError(ValueError):
    """Invalid configuration. The message names the file, the key and what would be valid."""
