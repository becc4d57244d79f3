"""Domain errors: each carries one line a user can act on. The CLI turns them into exit code 1."""


class TriforceError(Exception):
    """Base of every error the CLI reports as a single line."""


class ConfigError(TriforceError):
    """Inconsistent or out-of-range settings."""


class PromptError(TriforceError):
    """A prompt that cannot be read or does not fit the model."""


class ModelLoadError(TriforceError):
    """A model that cannot be found, read or paired with the target."""
