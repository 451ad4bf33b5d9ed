"""moelight as a Ray Data stage, for Python (the CLI's `moelight run --ray` is moelight/jobs/ray/).

    from moelight.ray import ProcessorConfig, build_processor

Importing this package does not import Ray; building or running a processor does.
"""

from moelight.ray.processor import Processor, ProcessorConfig, build_processor

__all__ = ["Processor", "ProcessorConfig", "build_processor"]
