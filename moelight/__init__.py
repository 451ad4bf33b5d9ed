"""moelight: high-throughput batch inference for Mixture-of-Experts LLMs."""
