"""The configuration error type and how messages locate a key, apart from the loader and validation
so that neither imports the other."""


class ConfigError(ValueError):
    """Invalid configuration. The message names the file, the key and what would be valid."""


def located(source: str, key: str) -> str:
    """``file: key`` for a message; ``source`` (the file the key was read from) may carry ``env``,
    the ``NAME=value`` of the environment variable that set it, which is named too."""
    env = getattr(source, "env", None)
    return f"{source}: {key}" + (f" (environment variable {env})" if env else "")
