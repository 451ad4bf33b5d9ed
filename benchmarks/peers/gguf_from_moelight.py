"""Write a moelight dummy preset as a GGUF file llama.cpp runs: the same random weights.

The weights are the ones `moelight run --model PRESET --load-format dummy` uses (seed 0), laid
out as llama.cpp's converter lays out a MixtralForCausalLM: `llama` architecture, experts stacked
as ffn_{gate,up,down}_exps, q/k rows permuted from the rotate-half layout to llama.cpp's
interleaved one. llama-batched-bench never tokenizes, but a model needs a vocabulary: a
SentencePiece-style one of the preset's size (<unk>, <s>, </s>, the 256 byte tokens, fillers).

    python benchmarks/peers/gguf_from_moelight.py --preset bench-1b --out /tmp/bench-1b-bf16.gguf

Only Mixtral-shaped presets (tiny, bench-1b, mixtral-*). The gguf package is llama.cpp's own
(gguf-py in its source tree), so the file matches the binary built by build_llama_cpp.sh.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DEFAULT_LLAMA = Path.home() / ".cache/moelight-peers/llama_cpp_python-0.3.36/vendor/llama.cpp"


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(model) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> float32 tensor, in llama.cpp's layout."""
    cfg = model.config
    f = cfg.intermediate_size
    out = {"token_embd.weight": model.embed_tokens.weight, "output_norm.weight": model.norm.weight,
           "output.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        a, moe = layer.self_attn, layer.mlp
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": layer.input_layernorm.weight,
            p + "attn_q.weight": permute(a.q_proj.weight, cfg.num_heads),
            p + "attn_k.weight": permute(a.k_proj.weight, cfg.num_kv_heads),
            p + "attn_v.weight": a.v_proj.weight,
            p + "attn_output.weight": a.o_proj.weight,
            p + "ffn_norm.weight": layer.post_attention_layernorm.weight,
            p + "ffn_gate_inp.weight": moe.gate.weight,
            p + "ffn_gate_exps.weight": moe.gate_up_proj[:, :f],  # [E, f, h]
            p + "ffn_up_exps.weight": moe.gate_up_proj[:, f:],
            p + "ffn_down_exps.weight": moe.down_proj,  # [E, h, f]
        }
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def write_gguf(preset: str, out: Path, dtype: str, llama_dir: Path, seed: int = 0) -> Path:
    sys.path.insert(0, str(llama_dir / "gguf-py"))
    import gguf

    from moelight.loading.presets import preset_config
    from moelight.loading.weights import build_model

    cfg = preset_config(preset)
    if cfg.model_type != "mixtral":
        raise SystemExit(f"{preset}: only Mixtral-shaped presets convert (model_type {cfg.model_type})")
    model = build_model(cfg, torch.bfloat16 if dtype == "bf16" else torch.float32, None, seed)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"moelight-{preset}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k)
    ftype = gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bf16" else gguf.LlamaFileType.ALL_F32
    w.add_file_type(ftype)
    # vocabulary: specials, byte fallback tokens, fillers (never used by batched-bench)
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"▁t{i}" for i in range(cfg.vocab_size - len(toks))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + \
        [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (cfg.vocab_size - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for name, t in tensors(model).items():
        data = t.numpy()
        if dtype == "bf16" and data.ndim > 1:  # llama.cpp keeps norms (1-D) in float32, as its converter does
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench-1b")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA, help="llama.cpp source tree (for gguf-py)")
    args = ap.parse_args()
    print(write_gguf(args.preset, args.out, args.dtype, args.llama_dir))


if __name__ == "__main__":
    main()
