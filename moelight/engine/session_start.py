"""Where a front end gets its session: rank 0's (or the only one), or nothing on a torchrun follower."""

from __future__ import annotations

from collections.abc import Callable

from moelight.engine.options import EngineOptions
from moelight.engine.session import EngineSession
from moelight.engine.tp_follower import follow_torchrun


def open_session(opts: EngineOptions, log: Callable[[str], None] | None = None) -> EngineSession | None:
    """The session a front end runs its jobs on; None on a torchrun rank other than 0, which has
    served rank 0's session until it closed (rank 0 owns the dataset, the output and the report)."""
    opts.validate()
    if follow_torchrun(opts):
        return None
    return EngineSession(opts, log)
