"""Tensor parallelism on the emulated devices: wall clock of one job on 1 and 2 ranks.

Each rank is a process with its own emulated accelerator and its own emulated link (a copy
thread that takes bytes / bandwidth), and pages only its half of every expert. With a slow link
the decode step is link-bound, so 2 ranks should approach 2x. What this host cannot show: both
ranks compute on the same CPU cores (compute does not scale here), and the emulated links do
not draw on host memory bandwidth (the HRM's host roof is not exercised).

    python benchmarks/bench_tp_emulated.py [--link-gbps 1.0] [--runs 3] [--quantize int4]

With --quantize the experts are held as int8 / int4 codes: each rank pages its part of them over
its link (4.5 bits a weight for int4, against float32's 32) and expands them on its device.

A small Mixtral (4 layers, h 512, expert width 1536, 8 experts, 8/4 heads, float32, dummy
weights), 64 requests of 16 new tokens, policy N = 64 = 16 x 4, all experts paged (r_w = 0),
attention on the CPU, the MoE FFN on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hrm.hardware_presets import get_hardware  # noqa: E402
from moelight import LLM, SamplingParams  # noqa: E402

CONFIG = {"model_type": "mixtral", "vocab_size": 2000, "hidden_size": 512, "intermediate_size": 1536,
          "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024, "rope_theta": 1e6,
          "bos_token_id": 1, "eos_token_id": 2}
POLICY = {"batch_size": 64, "micro_batch_size": 16, "num_micro_batches": 4, "attn_on_gpu": False,
          "ffn_on_gpu": True, "r_w": 0.0, "r_c": 0.0, "dtype": "float32"}


def setup(root: Path, link_gbps: float) -> tuple[Path, Path, Path]:
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    hw = get_hardware("t4").to_dict()
    hw["name"] = f"t4, {link_gbps} GB/s link"
    hw["link"] = {"h2d": link_gbps * 1e9, "d2h": link_gbps * 1e9}
    (root / "hw.json").write_text(json.dumps(hw))
    (root / "policy.json").write_text(json.dumps(POLICY))
    return model, root / "hw.json", root / "policy.json"


def run(model: Path, hw: Path, policy: Path, gpus: int, prompts: list[str], quantize: str = "none"):
    llm = LLM(str(model), load_format="dummy", dtype="float32", device="emulated", hardware=str(hw),
              policy=str(policy), gpus=gpus, quantize=quantize)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        return llm.last_report, [o.outputs[0].token_ids for o in outs]
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-gbps", type=float, default=1.0, help="emulated link, GB/s per direction")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quantize", default="none", help="experts held as none | int8 | int4 (as moelight run)")
    a = ap.parse_args()
    prompts = [f"Request {i}: " + "tell me more " * (3 + i % 7) for i in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        model, hw, policy = setup(Path(tmp), a.link_gbps)
        per_ranks: dict[int, list] = {1: [], 2: []}
        tokens: dict[int, list] = {}
        for _ in range(a.runs):
            for g in (1, 2):  # alternate, so a change in the host's state hits both
                report, tokens[g] = run(model, hw, policy, g, prompts, a.quantize)
                per_ranks[g].append(report)
    same = tokens[1] == tokens[2]
    print(f"\nemulated link {a.link_gbps} GB/s per direction per rank, experts {a.quantize}, {a.runs} runs each "
          f"(median [min-max]); tokens of 1 and 2 ranks identical: {same}\n")
    print("| ranks | decode tok/s | end-to-end tok/s | HRM decode tok/s | bound (HRM) |")
    print("|---|---|---|---|---|")
    med = {}
    for g, reps in per_ranks.items():
        dec = [r.decode_tokens_per_s for r in reps]
        e2e = [r.end_to_end_tokens_per_s for r in reps]
        med[g] = statistics.median(dec)
        span = lambda xs: f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"  # noqa: E731
        p = reps[0].prediction
        print(f"| {g} | {span(dec)} | {span(e2e)} | {p['decode_tokens_per_s']:.1f} | {p['binding']} |")
    print(f"\ndecode speed-up 2 ranks / 1 rank: {med[2] / med[1]:.2f}x")


if __name__ == "__main__":
    main()
