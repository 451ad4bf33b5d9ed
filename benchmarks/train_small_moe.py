"""Train a small Mixtral on text every machine has, so expert caches meet real (trained) routing.

Random weights route almost uniformly and make every cache policy look alike. This trains a
Mixtral-shaped model (8 experts, top-2, as Mixtral 8x7B) on Python's standard-library sources
(found through `sysconfig`; code and docstrings), with its own byte-level BPE `tokenizer.json`,
and saves a Hugging Face folder that `moelight run --model DIR` loads through the normal path.
Files are split into training and held-out sets by a hash of their path.

It then measures, on held-out text, the loss and how the routing is distributed, for the trained
model and for the same shape with random weights:
- entropy of each layer's expert usage (bits; log2(8) = 3 is uniform),
- skew: the share of the layer's routing the most used 2 experts take (2/8 = 0.25 is uniform),
- stickiness: how often a token's top-1 expert is among the previous token's top-2 in the same
  layer (2/8 = 0.25 when independent),
- per-sequence concentration: the share of a sequence's routing its own 2 most used experts per
  layer take (what an expert cache lives on).

    python benchmarks/train_small_moe.py --minutes 18 --output tests/data/stdlib-moe
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_local_experts=8,
             num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=512, rope_theta=1e4, router_aux_loss_coef=0.01, output_router_logits=True,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training, held-out) .py files of the standard library, tests and site-packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if not {"site-packages", "test", "tests", "idle_test"} & set(f.relative_to(root).parts))
    held = [f for f in files if int(hashlib.sha1(str(f.relative_to(root)).encode()).hexdigest(), 16) % 10 == 0]
    return [f for f in files if f not in set(held)], held


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "<pad>", "model_max_length": SHAPE["max_position_embeddings"]}, indent=2))
    return tok


def encode(tok, texts: list[str]) -> np.ndarray:
    """One stream of token ids, each file closed by </s>."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(2)
    return np.asarray(ids, dtype=np.int64)


def batches(stream: np.ndarray, batch: int, seq: int, gen: np.random.Generator):
    while True:
        starts = gen.integers(0, len(stream) - seq - 1, batch)
        yield torch.from_numpy(np.stack([stream[s : s + seq] for s in starts]))


@torch.no_grad()
def evaluate(model, stream: np.ndarray, seq: int, n_seqs: int) -> dict:
    """Held-out loss and routing statistics over n_seqs windows of seq tokens."""
    model.eval()
    starts = np.linspace(0, len(stream) - seq - 1, n_seqs).astype(int)
    x = torch.from_numpy(np.stack([stream[s : s + seq] for s in starts]))
    out = model(input_ids=x, labels=x, output_router_logits=True)
    E, k = SHAPE["num_local_experts"], SHAPE["num_experts_per_tok"]
    stats = {"held_out_loss": float(out.loss - model.config.router_aux_loss_coef * out.aux_loss)
             if out.aux_loss is not None else float(out.loss), "layers": []}
    for logits in out.router_logits:  # [n_seqs * seq, E] per layer
        top = torch.topk(logits.float(), k, dim=-1).indices.view(n_seqs, seq, k)
        counts = torch.bincount(top.reshape(-1), minlength=E).float()
        share = counts / counts.sum()
        entropy = float(-(share * torch.log2(share.clamp_min(1e-12))).sum())
        skew = float(share.sort(descending=True).values[:k].sum())
        first, prev = top[:, 1:, 0], top[:, :-1, :]
        sticky = float((first.unsqueeze(-1) == prev).any(-1).float().mean())
        per_seq = torch.stack([torch.bincount(t.reshape(-1), minlength=E) for t in top]).float()
        conc = float((per_seq.sort(-1, descending=True).values[:, :k].sum(-1) / per_seq.sum(-1)).mean())
        stats["layers"].append({"entropy_bits": entropy, "top2_share": skew, "sticky_top1_in_prev_top2": sticky,
                                "sequence_top2_share": conc})
    model.train()
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=Path, default=Path("tests/data/stdlib-moe"))
    ap.add_argument("--minutes", type=float, default=18.0, help="training time budget")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    ap.add_argument("--expert-width", type=int, default=SHAPE["intermediate_size"])
    a = ap.parse_args()
    SHAPE.update(num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.expert_width,
                 head_dim=a.hidden // SHAPE["num_attention_heads"])
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(a.seed)
    a.output.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_files, held_files = stdlib_files()
    train_text, held_text = read(train_files), read(held_files)
    tok = train_tokenizer(train_text, a.output)
    train_ids, held_ids = encode(tok, train_text), encode(tok, held_text)
    print(f"{len(train_files)} training files ({len(train_ids)} tokens), {len(held_files)} held out "
          f"({len(held_ids)} tokens); tokenizer in {time.perf_counter() - t0:.1f} s")

    cfg = MixtralConfig(**SHAPE)
    model = MixtralForCausalLM(cfg)
    random_stats = evaluate(model, held_ids, a.seq, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = a.minutes * 60
    data = batches(train_ids, a.batch, a.seq, np.random.default_rng(a.seed))
    start, step, tokens, log = time.perf_counter(), 0, 0, []
    while time.perf_counter() - start < budget:
        frac = (time.perf_counter() - start) / budget
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(data)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, tokens = step + 1, tokens + x.numel()
        if step % 50 == 0:
            log.append({"step": step, "tokens": tokens, "loss": loss.item(), "seconds": time.perf_counter() - start})
            print(f"step {step} tokens {tokens} loss {loss.item():.3f} lr {lr:.2e} "
                  f"{tokens / (time.perf_counter() - start):.0f} tok/s", flush=True)
    trained_stats = evaluate(model, held_ids, a.seq, 32)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(a.output, safe_serialization=True)
    report = {"command": "python benchmarks/train_small_moe.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "shape": SHAPE, "train_files": len(train_files), "held_out_files": len(held_files),
        "train_tokens_available": int(len(train_ids)), "held_out_tokens": int(len(held_ids)),
        "steps": step, "tokens_seen": tokens, "train_seconds": time.perf_counter() - start,
        "trained": trained_stats, "random_weights": random_stats, "log": log}
    (a.output / "training_report.json").write_text(json.dumps(report, indent=2))
    for name, s in (("random", random_stats), ("trained", trained_stats)):
        print(f"{name}: held-out loss {s['held_out_loss']:.3f}; per layer " + "; ".join(
            f"H {x['entropy_bits']:.2f} top2 {x['top2_share']:.2f} sticky {x['sticky_top1_in_prev_top2']:.2f} "
            f"seq-top2 {x['sequence_top2_share']:.2f}" for x in s["layers"]))


if __name__ == "__main__":
    main()
