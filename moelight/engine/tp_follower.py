"""A tensor-parallel follower rank: it serves rank 0's session call for call until told to stop.

Rank 0's session hands `serve` to the process launcher (parallel/rank_group.py) as the spawned
ranks' entry point; under torchrun, every rank other than 0 enters it from `follow_torchrun` where
its front end starts. Rank 0 owns the dataset, the output and the report: a follower writes nothing.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from moelight.parallel.rank_group import (
    FAULT_ENV,
    RankGroup,
    join_group,
    threads_per_rank,
    torchrun_rank,
)
from moelight.parallel.sharding import TensorParallelError
from moelight.planning.hardware_choice import resolve_device


def follow_torchrun(options) -> bool:
    """Under torchrun, on a rank other than 0: serve rank 0's job, then return True (the caller
    stops). False everywhere else."""
    found = torchrun_rank()
    if found is None or found[0] == 0:
        return False
    device = resolve_device(options.device)
    if device == "cpu":
        raise TensorParallelError("tensor parallelism under torchrun runs on --device cuda or emulated, "
                                  "not the plain CPU executor")
    group = join_group(device, found[0], found[1], log=getattr(options, "log", None))
    torch.set_num_threads(threads_per_rank(found[1]))
    try:
        serve(group, options)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return True


def serve(group: RankGroup, options) -> None:
    """A follower's loop: the same session calls as rank 0, in the same order, until "stop"."""
    from moelight.engine.session import EngineSession

    session = EngineSession(options, tensor_parallel=group)
    session.load()
    engine = None
    while True:
        command, args = group.receive()
        _inject_fault(group.rank, command, engine)
        if command == "engine":
            engine = None  # the old engine's executor must not hold device memory while the new one is built
            engine = session.engine(*args)
        elif command == "generate":
            engine.generate(*args)
        elif command == "stop":
            session.close_executor()
            return
        else:
            raise TensorParallelError(f"unknown command {command!r} from rank 0")


def _inject_fault(rank: int, command: str, engine) -> None:
    """MOELIGHT_TP_FAULT="rank:command" raises on that command; "rank:decode:K" in the K-th decode
    pass of the next generate (a rank dying mid-job, after results were written), "rank:decode:K:kill"
    killed there by SIGKILL (it cannot report: out of memory, kill -9); "rank:logits"
    makes that rank's decode logits prefer other tokens (its own sampling would go astray)."""
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) < 2 or spec[0] != str(rank):
        return
    if spec[1] == command:
        raise RuntimeError(f"fault injected by {FAULT_ENV}")
    if spec[1] == "logits" and command == "generate":
        executor = engine.executor
        decode = executor.decode
        executor.decode = lambda *args, **kwargs: [-x for x in decode(*args, **kwargs)]
    if spec[1] == "decode" and command == "generate":
        executor, calls = engine.executor, [0]
        decode = executor.decode

        def failing_decode(*args, **kwargs):
            calls[0] += 1
            if calls[0] >= int(spec[2]):
                if spec[3:] == ["kill"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"fault injected by {FAULT_ENV} in decode pass {calls[0]}")
            return decode(*args, **kwargs)

        executor.decode = failing_decode
