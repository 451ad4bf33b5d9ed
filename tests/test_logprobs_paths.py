"""prompt_logprobs and logprobs through every execution path that produces logits: CGOPipe on the
emulated device (each schedule), latency mode (the device expert cache) and tensor parallelism, with
a shared prefix read through the paged cache, give transformers' float32 log-softmax, as the plain
CPU engine does (tests/test_model_families.py checks that one for every family)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moelight import LLM, SamplingParams  # noqa: E402
from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402

# 8 heads, 4 KV heads: two ranks divide it
SHAPE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=48,
             num_hidden_layers=2, vocab_size=320)
SYSTEM = [(7 * i + 3) % 311 + 3 for i in range(34)]  # two full KV pages shared (prefix sharing where it runs)
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], SYSTEM + [101, 3, 3, 250, 12], SYSTEM + [9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 77]]
# the last prompt asks for no prompt logprobs, so it reads the second's pages (a prompt_logprobs request
# computes every position)
PARAMS = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3,
                         prompt_logprobs=3 if k < 2 else None) for k in range(3)]
PATHS = {
    "cgopipe": dict(device="emulated", hardware="t4", mode="throughput", schedule="cgopipe"),
    "flexgen": dict(device="emulated", hardware="t4", mode="throughput", schedule="flexgen"),
    "latency": dict(device="emulated", hardware="t4", mode="latency"),
    "tp2": dict(device="emulated", hardware="t4", mode="throughput", gpus=2),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_model(seed=4, **SHAPE)
    return hf.eval(), save_checkpoint(hf, tmp_path_factory.mktemp("logprob_paths") / "ckpt")


@pytest.mark.parametrize("path", list(PATHS))
def test_logprobs_through_every_path_are_transformers_log_softmax(checkpoint, path):
    hf, folder = checkpoint
    micro = {} if path == "latency" else {"micro_batch_size": 2}  # latency mode runs one batch, no micro-batches
    llm = LLM(str(folder), dtype="float32", batch_size=3, skip_tokenizer_init=True, **micro, **PATHS[path])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        report = llm.last_report
    finally:
        llm.close()
    assert report.prefix_reused_tokens == 32, report.prefix_reused_tokens  # the last prompt reads the second's
    if path == "latency":
        assert report.cache, "latency mode did not run the expert cache"
    else:
        assert report.runtime.get("schedule") == PATHS[path].get("schedule", "cgopipe"), report.runtime
        assert report.policy.get("tensor_parallel", 1) == PATHS[path].get("gpus", 1)
    assert [o.prompt_logprobs is not None for o in outs] == [True, True, False]
    for p, out in zip(PROMPTS, outs, strict=True):
        sample = out.outputs[0]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p + sample.token_ids])).logits[0].float(), -1)
        assert sample.token_ids == ref[len(p) - 1:-1].argmax(-1).tolist(), path  # greedy
        entries = []
        if out.prompt_logprobs is not None:
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
            entries = [(out.prompt_logprobs[i], p[i], ref[i - 1]) for i in range(1, len(p))]
        entries += [(sample.logprobs[t], sample.token_ids[t], ref[len(p) - 1 + t]) for t in range(4)]
        for entry, token, row in entries:
            assert abs(entry[token].logprob - float(row[token])) < 1e-4, path
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            for lp, tid in zip(*torch.topk(row, 3), strict=True):
                assert abs(entry[int(tid)].logprob - float(lp)) < 1e-4, path
