"""Errors a user can act on: each says what went wrong, where, and what to do."""


class MoelightError(Exception):
    """Base class; the CLI prints these without a traceback."""


class ConfigError(MoelightError):
    """A model config.json that moelight cannot run."""


class WeightsError(MoelightError):
    """Missing, truncated or mismatched safetensors weights."""


class PromptError(MoelightError):
    """A prompt that cannot be generated from (empty, too long for the model)."""


class NumericalError(MoelightError):
    """A pass produced logits that are not finite (an overflow, e.g. of float16 activations)."""


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or cannot format a request; the message says what to do."""
