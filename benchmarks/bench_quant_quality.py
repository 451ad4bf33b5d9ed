"""Held-out perplexity of a trained moelight model with its routed experts in bf16, int8 and int4.

The model is the one `benchmarks/train_small_moe.py` trains on the Python standard library (a
4-layer copy is committed in tests/data/stdlib-moe; its 32-layer benchmark model is written to
benchmarks/models/stdlib-moe-32l); the text is that script's held-out files (split by a hash of
the path). Every variant runs on the engine's CPU path (the fused expert kernel, --quantize's
round-to-nearest quantization at load); only the experts change between rows.

    python benchmarks/bench_quant_quality.py --model tests/data/stdlib-moe --tokens 65536
    python benchmarks/bench_quant_quality.py --model benchmarks/models/stdlib-moe-32l --tokens 65536

Prints a markdown table (perplexity, and its change against bf16). ~1 minute for the 4-layer model.

`--per-token` runs each position's MoE block (and the rest of its layer after attention) as a call
of its own, one row per expert, as decode does: on AVX2 that is where int8 / int4 experts multiply on
int8 activations, so each quantized variant is scored twice, with and without them
(cpu_kernels.dispatch.INT8_ACTIVATIONS).

    python benchmarks/bench_quant_quality.py --model tests/data/stdlib-moe --tokens 16384 --per-token
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_small_moe import read, stdlib_files  # noqa: E402

from cpu_kernels import dispatch, prefill_attention  # noqa: E402
from moelight.loading.hf_config import load_config  # noqa: E402
from moelight.loading.weights import build_model  # noqa: E402
from moelight.runtime.cpu_linear import pack_model  # noqa: E402
from moelight.runtime.forward import attention_extras  # noqa: E402

VARIANTS = ("bf16", "int8", "int4", "int4-g32")


@torch.inference_mode()
def sequence_logits(model, tokens: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Logits [T, V] of every position of one sequence (the engine's prefill, all positions kept);
    `per_token`: each position's post-attention part of a layer (its MoE block) in a call of its own."""
    positions = torch.arange(len(tokens))
    cu = torch.tensor([0, len(tokens)])
    x = model.embed_tokens(tokens)
    cos, sin = model.rotary(positions, x.dtype)
    scale = model.config.head_dim**-0.5
    for li, layer in enumerate(model.layers):
        q, k, v = layer.pre_attention(x, cos, sin)
        attn = prefill_attention(q, k, v, cu, scale, **attention_extras(model, li)).flatten(1)
        if per_token:
            x = torch.cat([layer.post_attention(x[i:i + 1], attn[i:i + 1]) for i in range(len(tokens))])
        else:
            x = layer.post_attention(x, attn)
    return model.logits(x)


def perplexity(model, stream: list[int], seq: int, n_tokens: int, per_token: bool = False) -> float:
    nll, count = 0.0, 0
    for start in range(0, min(n_tokens, len(stream) - seq - 1), seq):
        chunk = torch.tensor(stream[start : start + seq + 1])
        logits = sequence_logits(model, chunk[:-1], per_token)
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += seq
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "tests/data/stdlib-moe"))
    ap.add_argument("--tokens", type=int, default=65536, help="held-out tokens scored")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--per-token", action="store_true", help="one row per expert call, as decode")
    a = ap.parse_args()
    model_dir = Path(a.model)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _, held = stdlib_files()
    stream = [t for text in read(held) for t in tok.encode(text).ids]
    base = build_model(load_config(model_dir), torch.bfloat16, model_dir)
    rows = []
    for name in VARIANTS:
        model = copy.deepcopy(base)
        pack_model(model, "none" if name == "bf16" else name.partition("-g")[0], int(name.partition("-g")[2] or 128))
        modes = [(name, True)] if name == "bf16" or not a.per_token else [
            (f"{name}, bf16 activations", False), (f"{name}, int8 activations", True)]
        for label, int8_act in modes:
            dispatch.INT8_ACTIVATIONS = int8_act
            rows.append((label, perplexity(model, stream, a.seq, a.tokens, a.per_token)))
    ref = rows[0][1]
    how = ", each position's MoE in its own call" if a.per_token else ""
    print(f"{model_dir.name}: held-out perplexity over {a.tokens} tokens (sequences of {a.seq}{how})\n")
    print("| experts | perplexity | vs bf16 |\n|---|---|---|")
    for name, ppl in rows:
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / ref - 1):+.2f}% |")


if __name__ == "__main__":
    main()
