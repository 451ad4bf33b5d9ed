"""Accelerators the pipelined executors run on: a small Device interface (memory with a budget,
pinned host memory, lanes of ordered work with events), CUDA and an emulated device that runs the
same schedules on any machine; `registry.create_device(kind)` builds one by name."""
