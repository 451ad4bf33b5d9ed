"""Two threads calling one `LLM` at once: the calls run one at a time and each gets what it gets alone.
They share the session's executor, which a job may rebuild (a larger CGOPipe runtime in throughput mode,
a fresh expert cache in latency mode): unserialised, the running job hung on the closed one or read its
freed slots."""

from __future__ import annotations

import threading

import pytest

from moelight import LLM, SamplingParams
from tests.checkpoints import make_hf_model, save_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = {"small": ["hello world"], "big": [f"prompt number {i} " * 4 for i in range(10)]}
JOIN_S = 60  # a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(make_hf_model(0), tmp_path_factory.mktemp("threads") / "m")


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["throughput", "latency"])
def test_two_threads_on_one_llm_get_their_single_threaded_results(ckpt, mode):
    """The small job holds its engine (the runtime sized for it) until the big job has its own, or for
    a second when the big job waits its turn, as it should."""
    def fresh() -> LLM:
        return LLM(str(ckpt), dtype="float32", device="emulated", mode=mode)

    llm = fresh()
    alone = {name: tokens(llm.generate(p, GREEDY)) for name, p in PROMPTS.items()}
    llm.close()
    llm, got = fresh(), {}
    small_engine, big_engine = threading.Event(), threading.Event()
    real_engine = llm.session.engine

    def engine(*args, **kwargs):
        built = real_engine(*args, **kwargs)
        if threading.current_thread().name == "small":
            small_engine.set()
            big_engine.wait(1)
        else:
            big_engine.set()
        return built

    llm.session.engine = engine

    def job(name: str) -> None:
        try:
            got[name] = tokens(llm.generate(PROMPTS[name], GREEDY))
        except BaseException as e:  # noqa: BLE001 - the assertion below names it
            got[name] = repr(e)

    small = threading.Thread(target=job, args=("small",), name="small", daemon=True)
    big = threading.Thread(target=job, args=("big",), name="big", daemon=True)
    small.start()
    assert small_engine.wait(JOIN_S)
    big.start()
    for t in (small, big):
        t.join(JOIN_S)
    assert not small.is_alive() and not big.is_alive(), f"a call hung ({mode} mode)"
    assert got == alone
    llm.close()


def test_an_interrupted_call_lets_the_next_one_run(ckpt):
    """Ctrl-C (or any error) inside a call gives the LLM back: another thread's call runs, not waits forever."""
    llm = LLM(str(ckpt), dtype="float32")

    def interrupted(**_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS["small"], GREEDY, use_tqdm=interrupted)
    got: dict = {}
    other = threading.Thread(target=lambda: got.update(small=tokens(llm.generate(PROMPTS["small"], GREEDY))),
                             daemon=True)
    other.start()
    other.join(JOIN_S)
    assert not other.is_alive() and got["small"][0]
    llm.close()
