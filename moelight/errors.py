"""Errors a user can act on: each says what went wrong, where, and what to do."""


class MoelightError(Exception):
    """Base class; the CLI prints these without a traceback."""


class OptionError(MoelightError):
    """An option with a value moelight cannot use; the message names the option and the valid choices."""


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


def broken_download_link(path) -> str | None:
    """What to say of a link whose file is gone, as an interrupted Hugging Face download leaves one in
    snapshots/<hash>/ (the blob still `.incomplete`); None for anything else."""
    if path.is_symlink() and not path.exists():
        return (f"{path}: a link to {path.readlink()}, which does not exist: the download is incomplete; "
                "download the model again (e.g. `hf download REPO_ID`)")
    return None
