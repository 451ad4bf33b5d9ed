"""CGOPipe runtime: schedules as task graphs, a simulator that times them with HRM costs,
and an executor that runs them on a device (CUDA, or an emulated accelerator).

Import the submodules directly; this package imports nothing heavy on its own.
"""

SCHEDULE_NAMES = ("cgopipe", "flexgen", "flexgen-cpu", "overlap-unpaged")
