"""An `LLM` frees its runtime when closed, when its `with` block ends, and when it is dropped without
either: no executor thread (lanes, copy streams, the expert-copy worker) stays behind, and nothing keeps
the model alive. The finalizer holds the session, not the LLM, and no worker thread reaches the LLM."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from moelight import LLM, SamplingParams
from tests.checkpoints import make_hf_model, save_checkpoint

pytestmark = pytest.mark.no_race_check  # what a closed LLM frees; ordering: the runtimes' own tests

GREEDY = SamplingParams(max_tokens=4, temperature=0)
RUNTIMES = {"emulated-throughput": {"device": "emulated", "mode": "throughput"},
            "emulated-latency": {"device": "emulated", "mode": "latency"},
            "cpu": {"device": "cpu"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(make_hf_model(0), tmp_path_factory.mktemp("lifecycle") / "m")


def engine_threads() -> set[threading.Thread]:
    """moelight's own (every worker it starts is named moelight-...; tqdm's monitor is not ours)."""
    return {t for t in threading.enumerate() if t.name.startswith("moelight")}


def settled(check, seconds: float = 10.0) -> bool:
    """`check()` becomes true within `seconds` (worker threads take a moment to see they should stop)."""
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        gc.collect()
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_a_dropped_llm_leaves_no_thread_and_frees_its_model(ckpt, runtime):
    before = engine_threads()
    llm = LLM(str(ckpt), dtype="float32", **RUNTIMES[runtime])
    llm.generate(["hello"], GREEDY)
    model = weakref.ref(llm.model)
    del llm
    gc.collect()
    assert settled(lambda: model() is None), "the model outlived its LLM"
    assert settled(lambda: engine_threads() <= before), engine_threads() - before


def test_leaving_a_with_block_closes_the_llm(ckpt):
    before = engine_threads()
    with LLM(str(ckpt), dtype="float32", device="emulated", mode="throughput") as llm:
        llm.generate(["hello"], GREEDY)
        assert engine_threads() - before  # the CGOPipe runtime's lanes
    assert settled(lambda: engine_threads() <= before), engine_threads() - before
    llm.close()  # closing again is a no-op


EXITS_OPEN = """
from moelight import LLM, SamplingParams
llm = LLM("tiny", load_format="dummy", device="emulated", mode="throughput", hardware="t4")
assert llm._finalizer.atexit is False
llm.generate([{"prompt_token_ids": list(range(3, 67))}] * 16, SamplingParams(max_tokens=4, ignore_eos=True),
             use_tqdm=False)
"""


def test_a_process_that_leaves_an_llm_open_exits_cleanly():
    """The finalizer does not close the runtime at interpreter exit: closing the emulated device's lanes
    while the interpreter tears down aborted the process (exit 134) on most runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", EXITS_OPEN], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
