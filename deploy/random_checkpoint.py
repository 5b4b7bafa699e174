"""Random-weight Hugging Face checkpoints of real model shapes (Qwen3, Qwen3.5 hybrid), for benchmarks:
metrale and transformers both load them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from metrale.workers.models.config import ModelConfig
from metrale.workers.models.decoder import CausalLM
from metrale.workers.models.layers import RMSNorm

# Qwen3-8B's dimensions.
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                tie_word_embeddings=False)
# A ~2B Qwen3.5 hybrid (about 1.9e9 parameters): 24 layers, three Gated DeltaNet layers to one
# full-attention layer, tied embeddings as in the small released Qwen3.5 models.
QWEN3_5_2B = dict(model_type="qwen3_5_text", hidden_size=2048, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  intermediate_size=6144, vocab_size=151936, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, tie_word_embeddings=True)
# Small shapes of the same architectures, to check the programs on CPU.
QWEN3_SMALL = dict(QWEN3_8B, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1024)
QWEN3_5_SMALL = dict(QWEN3_5_2B, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=512,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                     linear_value_head_dim=32)
ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}


def hf_config(shape: dict) -> dict:
    """The config.json of a checkpoint of `shape` (a dict like QWEN3_8B)."""
    raw = {"architectures": [ARCHITECTURE[shape["model_type"]]], **shape, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 4096, "attention_bias": False, "hidden_act": "silu",
           "dtype": "bfloat16", "eos_token_id": 0, "bos_token_id": None, "pad_token_id": None}
    if shape["model_type"] == "qwen3":
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    else:
        n = shape["num_hidden_layers"]
        raw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                              for i in range(n)]
        raw["partial_rotary_factor"] = 0.25
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0,
                                  "partial_rotary_factor": 0.25}
    return raw


def initial_values(model: CausalLM) -> dict[str, str]:
    """How each parameter starts: 'zeros' or 'ones' for norms (Qwen3.5's zero-centred RMSNorm
    scales by 1 + w), 'decay' / 'ones' for the Gated DeltaNet decay parameters, else 'normal'."""
    how = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, RMSNorm):
            how[prefix + "weight"] = "zeros" if module.offset else "ones"
        elif type(module).__name__ == "GatedRMSNorm":
            how[prefix + "weight"] = "ones"
        elif hasattr(module, "A_log"):
            how[prefix + "A_log"], how[prefix + "dt_bias"] = "decay", "ones"
    return how


def write_random_checkpoint(out: Path, shape: dict, device: str, seed: int = 0) -> Path:
    """config.json, model.safetensors (bfloat16; N(0, 0.02) matrices drawn on `device`, norms at
    their identity, decays as transformers initialises them) and a word-level tokenizer.json with
    one entry per id, so any token decodes. An existing checkpoint of the same config is kept."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    out = Path(out)
    raw = hf_config(shape)
    if ((out / "model.safetensors").is_file() and (out / "config.json").is_file()
            and json.loads((out / "config.json").read_text()) == raw):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dict(raw))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if raw["tie_word_embeddings"]:
        shapes.pop("lm_head.weight")
    how = initial_values(model)
    g = torch.Generator(device).manual_seed(seed)

    def draw(name, size):
        kind = how.get(name, "normal")
        if kind == "normal":
            t = torch.randn(size, generator=g, device=device) * 0.02
        elif kind == "decay":   # A = uniform(1, 16), as transformers draws it
            t = torch.empty(size, device=device).uniform_(1, 16, generator=g).log()
        else:
            t = torch.zeros(size) if kind == "zeros" else torch.ones(size)
        return t.to(torch.bfloat16).cpu()
    save_file({name: draw(name, size) for name, size in shapes.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(raw["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def random_prompts(count: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (count, length), generator=g).tolist()
