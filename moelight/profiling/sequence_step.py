"""The host's work per sequence in a decode step (scheduling, block tables, sampling, results), as
`moelight profile` measures it. Measuring it runs the engine, a layer above this one, so the engine
registers its probe here when its package is imported (moelight/engine/host_cost.py); without it
(profiling called on its own) the term stays unmeasured, 0.0, and the next run that loads the
engine retakes the profile.
"""

from __future__ import annotations

from collections.abc import Callable

_probe: list[Callable[[bool], float]] = []


def register(probe: Callable[[bool], float]) -> None:
    _probe[:] = [probe]


def measure_sequence_step(quick: bool = False) -> float:
    """Seconds per sequence per decode step; 0.0 where no engine has registered its probe."""
    return _probe[0](quick) if _probe else 0.0
