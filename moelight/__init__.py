"""moelight: high-throughput batch inference for Mixture-of-Experts LLMs.

The public names load lazily so `import moelight.<module>` stays cheap.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "MoelightError", "OptionError",
           "ConfigError", "PromptError"]


def __getattr__(name: str):
    if name == "LLM":
        from moelight.api.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moelight.sampling.params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from moelight.api import outputs

        return getattr(outputs, name)
    if name in ("MoelightError", "OptionError", "ConfigError", "PromptError"):  # what a caller catches
        from moelight import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'moelight' has no attribute {name!r}")
