"""moelight on Ray: `moelight run --ray` (moelight/ray/job.py) and a Ray Data processor for Python.

    from moelight.ray import ProcessorConfig, build_processor

Importing this package does not import Ray; building or running a processor does.
"""

from moelight.ray.processor import Processor, ProcessorConfig, build_processor

__all__ = ["Processor", "ProcessorConfig", "build_processor"]
