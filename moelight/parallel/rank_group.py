"""The ranks of a tensor-parallel job: one process per device, rank 0 in the caller's process.

`moelight run --gpus N` and `LLM(..., gpus=N)` start N-1 follower processes (spawned, so no
torchrun is needed) and join them in a torch.distributed group: NCCL on CUDA, gloo for the
emulated device. Under torchrun every process finds its rank in the environment instead, and
the processes other than rank 0 become followers where they start the job (`follow_torchrun`).
Rank 0 owns the dataset, the output and the progress bar; it sends each follower the same
engine calls it makes (`send`), so every rank runs the same batches, micro-batches and
sampling in lockstep and only the layers' all-reduces cross between them.

Control messages (rank 0's engine calls, the sampled tokens rank 0 broadcasts each step) travel
on a gloo group of their own, so they work, and fail fast, whatever the layers' backend.

Failure: a follower that raises reports its error on a queue and exits; rank 0's monitor
(rank_monitor.py) sees the exit and aborts the layers' communicator, so a collective waiting for
the dead rank ends (NCCL would wait for its watchdog), and `failure()` turns that into one
TensorParallelError naming the rank and its error (or the signal that killed it: such a rank
cannot report). After any failure rank 0 terminates the
followers instead of asking them to stop: one may be blocked in a collective that will never be
matched. MOELIGHT_TP_BLOCKING_COLLECTIVES=1 gives gloo NCCL's behaviour (a collective with a dead
peer waits for the abort instead of failing), so the failure path NCCL takes is tested without GPUs.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moelight.errors import MoelightError
from moelight.parallel.rank_monitor import RankMonitor
from moelight.parallel.rendezvous import rendezvous, rendezvous_timeout
from moelight.parallel.sharding import TensorParallelError

# a rank may wait this long for a peer between calls (e.g. while a slower rank still loads its shard)
_LOAD_TIMEOUT = timedelta(hours=2)
# the layers' all-reduces: a peer that has not answered in this long is gone (NCCL cannot see a dead peer)
_COMM_TIMEOUT_ENV = "MOELIGHT_TP_TIMEOUT"  # seconds, default 600
FAULT_ENV = "MOELIGHT_TP_FAULT"  # "rank:command": a follower raises there (failure-path tests)
BLOCKING_ENV = "MOELIGHT_TP_BLOCKING_COLLECTIVES"  # "1": gloo collectives wait for an abort, as NCCL's do


class CommunicatorAborted(TensorParallelError):
    """Rank 0 aborted the layers' communicator: a follower died (its own error says why)."""


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun with more than one rank."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _comm_timeout() -> timedelta:
    raw = os.environ.get(_COMM_TIMEOUT_ENV, "600")
    try:
        return timedelta(seconds=float(raw))
    except ValueError:
        raise TensorParallelError(f"{_COMM_TIMEOUT_ENV}={raw!r}: give the collective timeout in seconds") from None


@dataclass
class RankGroup:
    """This process's rank in the job's group and, on rank 0, the followers it spawned."""

    rank: int
    world: int
    device: str
    processes: list = field(default_factory=list)
    errors: object = None  # queue of (rank, message) from spawned followers
    threads_before: int = 0
    comm: object = None  # process group of the layers' all-reduces (shorter timeout than the default group)
    failed: bool = False  # a call failed: followers are terminated, not asked to stop
    ctrl: object = None  # gloo group of the control messages and the sampled tokens
    local_rank: int = 0  # this rank's GPU on its node
    blocking: bool = False  # a collective with a dead peer waits for an abort (NCCL; gloo under BLOCKING_ENV)
    aborted: threading.Event = field(default_factory=threading.Event)
    monitor: RankMonitor | None = None

    # ---- collectives ----
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (the layers' row-parallel outputs)."""
        if self.aborted.is_set():
            raise CommunicatorAborted("the layers' communicator was aborted after a rank failed")
        try:
            dist.all_reduce(t, group=self.comm)
        except Exception as e:
            if not self.blocking or self.device == "cuda":
                raise
            # NCCL's semantics: nothing notices the dead peer; an abort (or the group's timeout) ends the wait
            self.aborted.wait(_comm_timeout().total_seconds())
            raise CommunicatorAborted("the layers' communicator was aborted after a rank failed") from e
        return t

    def send(self, command: str, *args) -> None:
        """Rank 0: give every follower the next engine call."""
        dist.broadcast_object_list([(command, args)], src=0, group=self.ctrl)

    def receive(self) -> tuple[str, tuple]:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every rank takes rank 0's sampled tokens (each rank's own logits may differ in the last bits)."""
        if self.aborted.is_set():
            raise CommunicatorAborted("the layers' communicator was aborted after a rank failed")
        shared = tokens.to(torch.int64).contiguous()
        dist.broadcast(shared, src=0, group=self.ctrl)
        return shared

    @property
    def torch_device_index(self) -> int:
        return self.local_rank

    def abort(self, rank: int | None = None) -> None:
        """End every collective of the layers' communicator now (a follower died)."""
        self.aborted.set()
        if self.device == "cuda" and self.comm is not None:
            try:
                dist.distributed_c10d._abort_process_group(self.comm)
            except Exception:  # an older torch: the watchdog's timeout still ends the wait
                pass

    # ---- failure and shutdown ----
    def failure(self, error: BaseException) -> BaseException:
        """The error to raise on rank 0 after `error`: a follower's own error when one reported."""
        self.failed = True
        if (isinstance(error, TensorParallelError) and not isinstance(error, CommunicatorAborted)) \
                or isinstance(error, KeyboardInterrupt) or self.errors is None:
            return error
        found = self._follower_failure()
        if found is None:  # no follower failed: rank 0's error is the story
            return error
        rank, message = found
        return TensorParallelError(f"tensor-parallel rank {rank} of {self.world} failed: {message}")

    def _follower_failure(self) -> tuple[int, str] | None:
        """(rank, why) of a follower that failed: its own report, or how it ended when it could not
        report (killed by a signal, or gone without a word). A follower that raised reports before
        its sockets close, but rank 0 may see the closed sockets before the dead process is reaped:
        wait a little for either (longer once one is gone)."""
        deadline = time.monotonic() + 2
        gone_since = None
        while True:
            try:
                return self.errors.get(timeout=0.1)
            except Exception:  # queue.Empty
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(self.processes, start=1) if p.exitcode not in (None, 0)]
            now = time.monotonic()
            if dead and dead[0][1] < 0:  # killed by a signal: it never reports
                rank, code = dead[0]
                return rank, f"killed by {_signal_name(-code)} (exit code {code})"
            if dead and gone_since is None:
                gone_since, deadline = now, max(deadline, now + 10)
            if dead and now - gone_since > 1:  # exited without reporting (e.g. os._exit, out of memory)
                rank, code = dead[0]
                return rank, f"exited with code {code} without reporting an error"
            if now > deadline:
                return None

    def shutdown(self) -> None:
        """Rank 0: stop the followers (politely after success, at once after a failure)."""
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        ok = not self.failed
        if ok and self.rank == 0 and self.world > 1:
            try:
                self.send("stop")
            except Exception:
                ok = False
        for p in self.processes:
            p.join(timeout=30 if ok else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        self.processes = []
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        if self.threads_before:
            torch.set_num_threads(self.threads_before)
            self.threads_before = 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world: int) -> int:
    """The host's cores split between the ranks: each rank's CPU attention runs its own heads."""
    return max(1, (os.cpu_count() or 1) // world)


def join_group(device: str, rank: int, world: int, init_method: str | None = None, log=None,
               gone=None) -> RankGroup:
    """This process's place in the group (torchrun's environment when no init_method is given: its
    LOCAL_RANK names this rank's GPU; ranks moelight spawns use GPUs 0..N-1 by rank). The ranks meet
    within the rendezvous timeout (rendezvous.py); under torchrun `log` says where they meet; `gone`
    (rank 0 of spawned ranks) says why a spawned rank will never come."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if init_method is None else rank
    if device == "cuda":  # NCCL's collectives run on this rank's GPU
        torch.cuda.set_device(local_rank)
    if init_method is None:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        hint = (f"start all {world} ranks (torchrun --nproc-per-node {world} ...), or, if no launcher started "
                "this process, unset RANK and WORLD_SIZE (an outer launcher's): moelight then starts its own ranks")
    else:
        where, log = init_method.removeprefix("tcp://"), None  # spawned here: they meet in seconds
        hint = "a spawned rank did not start in time (is the host overloaded?)"
    rendezvous(backend_for(device), init_method, rank, world, where, hint, _LOAD_TIMEOUT, log, gone)
    comm = dist.new_group(list(range(world)), timeout=_comm_timeout())
    ctrl = dist.new_group(list(range(world)), timeout=_LOAD_TIMEOUT, backend="gloo")
    blocking = device == "cuda" or os.environ.get(BLOCKING_ENV) == "1"
    return RankGroup(rank, world, device, comm=comm, ctrl=ctrl, local_rank=local_rank, blocking=blocking)


def start_group(world: int, device: str, options, follower_main: str, log=None) -> RankGroup:
    """Rank 0 here; spawn followers 1..world-1, each running `follower_main(group, options)` once it
    has joined ("module:function", imported in the new process: the engine's follower loop, which
    this launcher does not import); under torchrun, join the group torchrun's processes form."""
    found = torchrun_rank()
    if found is not None:
        rank, size = found
        if size != world:
            raise TensorParallelError(f"torchrun started {size} ranks but the job asks for {world} GPUs; "
                                      f"pass --gpus {size} or start torchrun with --nproc-per-node {world}")
        group = join_group(device, rank, world, log=log)
        group.threads_before = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(world))
        return group
    _comm_timeout()  # a bad value is an error here, not in a follower
    rendezvous_timeout()
    if dist.is_initialized():  # one default process group per process: it belongs to the LLM that opened it
        raise TensorParallelError("a tensor-parallel group is already open in this process (another LLM with "
                                  "gpus > 1): close that one first (llm.close()), or run each tensor-parallel "
                                  "LLM in a process of its own")
    port = _free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_follower_main, args=(r, world, port, device, options, errors, follower_main),
                         daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        group = join_group(device, 0, world, f"tcp://127.0.0.1:{port}", gone=lambda: _exited_early(procs, errors))
    except BaseException as e:
        spawned = RankGroup(0, world, device, procs, errors, failed=True)
        error = spawned.failure(e)
        spawned.shutdown()
        raise error from None
    group.processes, group.errors = procs, errors
    group.monitor = RankMonitor(procs, group.abort)
    group.threads_before = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(world))
    return group


def _exited_early(procs: list, errors) -> str | None:
    """Why a spawned rank that has already exited will never join (None while all run): its own report,
    or, without one, that it died starting up, as a script without a `__main__` guard makes it do."""
    dead = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if p.exitcode is not None]
    if not dead:
        return None
    rank, code = dead[0]
    try:
        _, message = errors.get(timeout=0.5)  # a follower that failed in moelight's code reported it
        return f"tensor-parallel rank {rank} failed: {message}"
    except Exception:  # queue.Empty: it ended before moelight's code ran
        pass
    how = f"killed by {_signal_name(-code)} (exit code {code})" if code < 0 else f"exited with code {code}"
    return (f"the spawned rank {rank} {how} while starting, before it could join. Spawned ranks re-import "
            "the script that started the job: put the script's top-level code (what makes the LLM) under "
            "`if __name__ == \"__main__\":` (multiprocessing's start method is spawn; its error above says "
            "so when that is the cause)")


def _follower_main(rank: int, world: int, port: int, device: str, options, errors, follower_main: str) -> None:
    """A spawned rank: join the group, then run the follower's entry point (load its shard, replay
    rank 0's engine calls)."""
    torch.set_num_threads(threads_per_rank(world))
    os.environ["LOCAL_RANK"] = str(rank)  # not an outer launcher's: this process is rank `rank` of ours
    try:
        module, _, name = follower_main.partition(":")
        main = getattr(importlib.import_module(module), name)
        main(join_group(device, rank, world, f"tcp://127.0.0.1:{port}"), options)
    except BaseException as e:  # report, then exit non-zero: rank 0's next collective fails
        errors.put((rank, f"{type(e).__name__}: {e}"))
        if not isinstance(e, MoelightError):  # a bug: its traceback; a user error is rank 0's one line
            traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def load_together(group: RankGroup, load_shard):
    """Every rank loads its own shard at once (moelight/parallel/shard_loader.py), then they meet:
    a rank that failed to load is reported there, not at the first layer. Rank 0 ends the
    followers and raises one error if any rank fails."""
    try:
        shard = load_shard()
        group.barrier()
        return shard
    except BaseException as e:
        if group.rank == 0:
            error = group.failure(e)
            group.shutdown()
            if error is not e:
                raise error from e
        raise


def tensor_parallel_degree(opts, device: str) -> int:
    """Ranks a job runs on: torchrun's world, --gpus, else the GPU count of a preset or profile
    JSON; 1 on the CPU executor, and 1 for the measured profile (its GPUs run only when --gpus
    asks for them). A count the host cannot run is an error here, before anything loads."""
    found = torchrun_rank()
    if found is not None:
        if device == "cpu":
            raise TensorParallelError(f"torchrun started {found[1]} ranks, but tensor parallelism runs on "
                                      "--device cuda or emulated, not the plain CPU executor")
        if opts.gpus is not None and opts.gpus != found[1]:
            raise TensorParallelError(f"torchrun started {found[1]} ranks but --gpus is {opts.gpus}; "
                                      f"pass --gpus {found[1]} or start torchrun with --nproc-per-node {opts.gpus}")
        return found[1]
    if device == "cpu":
        return 1
    if opts.gpus is not None:
        n = max(1, opts.gpus)
    elif opts.hardware is None or opts.hardware.lower() == "profile":
        n = 1
    else:
        from hrm.hardware_presets import get_hardware

        try:
            n = max(1, get_hardware(opts.hardware).gpu_count)
        except (KeyError, ValueError, FileNotFoundError):
            n = 1  # validate() names a bad --hardware; planning reports an unreadable one
    if device == "cuda" and n > 1:
        import torch

        if n > torch.cuda.device_count():
            raise TensorParallelError(f"--gpus {n}: this host has {torch.cuda.device_count()} CUDA device(s); "
                                      "pass a smaller --gpus, or --device emulated to emulate them")
    return n
