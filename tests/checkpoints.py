"""Small random Hugging Face Mixtral checkpoints for tests (transformers is a test-only dependency).

`make_hf_model` builds a `MixtralForCausalLM` with seeded random weights; `save_checkpoint`
writes it as a Hugging Face model folder in either expert layout:

- "legacy": what `save_pretrained` writes in transformers 5 (per-expert
  `model.layers.{i}.block_sparse_moe.experts.{e}.w1/w2/w3.weight`, router `block_sparse_moe.gate`);
- "packed": transformers 5's in-memory layout, written by hand from the state_dict
  (`model.layers.{i}.mlp.experts.gate_up_proj` [E, 2f, h], `.down_proj` [E, h, f], `mlp.gate.weight`),

as one `model.safetensors` or as shards `model-0000k-of-0000n.safetensors` plus
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Defaults: a 2-layer model small enough for a 2-core CI machine. vocab >= 259 so the
# byte-level tokenizer (which LLM falls back to without tokenizer.json) fits.
DEFAULTS = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rope_theta=1e6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    # Larger than HF's 0.02 so logits spread out and greedy argmax has clear winners
    # (near-ties would make token-exact comparisons depend on summation order).
    initializer_range=0.2,
)


def make_hf_model(seed: int = 0, **overrides):
    """A float32 `MixtralForCausalLM` in eval mode with random weights (seeded)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    kw = {**DEFAULTS, **overrides}
    cfg = MixtralConfig(**kw)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).eval()
    # RMSNorm weights start at 1; randomise them a little so a norm applied wrongly shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    names = sorted(tensors)
    if shards <= 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    weight_map = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[s * per : (s + 1) * per]
        save_file({k: tensors[k].contiguous() for k in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _legacy_tensors(model) -> dict[str, torch.Tensor]:
    """Exactly what `save_pretrained` writes (per-expert w1/w2/w3 in transformers 5)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        files = sorted(Path(tmp).glob("*.safetensors"))
        tensors = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k).clone()
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in tensors), sorted(tensors)[:10]
    return tensors


def _packed_tensors(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    tensors = {k: v.detach().clone() for k, v in sd.items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors), sorted(tensors)[:10]
    return tensors


def save_checkpoint(model, out: str | Path, layout: str = "legacy", shards: int = 1,
                    byte_tokenizer: bool = True) -> Path:
    """Write `model` as a Hugging Face folder at `out`; returns the folder.

    `byte_tokenizer` adds a tokenizer_config.json naming moelight's byte-level tokenizer,
    so `moelight run --model DIR` has a tokenizer without a tokenizer.json.
    """
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if layout == "legacy":
        tensors = _legacy_tensors(model)
    elif layout == "packed":
        tensors = _packed_tensors(model)
    else:
        raise ValueError(f"layout {layout!r}")
    _write_shards(tensors, out, shards)
    model.config.save_pretrained(out)
    if byte_tokenizer:
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    return out


def tensor_names(folder: str | Path) -> list[str]:
    names = []
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.extend(fh.keys())
    return sorted(names)


def random_prompts(n: int, vocab: int, min_len: int = 2, max_len: int = 24, seed: int = 0) -> list[list[int]]:
    """Token-id prompts avoiding the specials 0..2 (pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]
