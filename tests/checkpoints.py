"""Tiny deterministic random-weight Qwen3 / Qwen3.5 Hugging Face checkpoints and transformers references for tests."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import pathlib

import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers



def _import_oracle_without_fla() -> None:
    """transformers binds flash-linear-attention's Triton kernels when `fla` imports (the GPU
    machine has it); the oracle runs on CPU in float32, so its Qwen3.5 module is imported with
    `fla` hidden and keeps the torch recurrences. The engine still imports fla afterwards."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None
    try:
        importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


_import_oracle_without_fla()
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|mask|>"]
# Released Qwen tokenizers split with this regex before ByteLevel; transformers' Qwen3_5Tokenizer (which AutoTokenizer
# forces for model_type "qwen3_5") hard-codes it plus NFC, so tokenizer.json must match it to encode identically.
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _corpus() -> list[str]:
    """A few KB of deterministic English + Python-like text, with some multi-byte characters."""
    names = ["alpha", "beta", "gamma", "delta", "café", "naïve", "über", "Zürich"]
    verbs = ["reads", "writes", "serves", "caches", "decodes", "schedules", "batches", "streams"]
    things = ["tokens", "requests", "pages", "blocks", "logits", "prompts", "weights", "tensors"]
    extras = ["日本語のテキスト", "東京 は 大きい", "smile 🙂 please", "résumé and señor", "naïve façade", "Grüße 👋"]
    lines = []
    for i in range(48):
        n, v, t = names[i % 8], verbs[(i * 3) % 8], things[(i * 5) % 8]
        lines.append(f"The {n} engine {v} {i + 1} {t} before the {things[(i + 2) % 8]} are ready.")
        lines.append(f"def {v}_{t}(self, {n.lower()}_{i}: int = {i * 7}) -> list[int]:")
        lines.append(f"    return [x * {i % 5 + 1} for x in range(self.{t}) if x % {i % 3 + 2} == 0]")
        lines.append(f"# {extras[i % len(extras)]} — item {i}: {n} {v} {t}.")
    return lines


def train_tokenizer(out_dir, vocab_size: int = 384) -> Tokenizer:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it into out_dir."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": 512}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def _default_layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def _text_config_kwargs(arch: str, vocab: int, eos: int, overrides: dict) -> dict:
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None,
    )
    if arch == "qwen3":
        kw = dict(common, num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif arch == "qwen3_5":
        kw = dict(
            common, num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    else:
        raise ValueError(f"unknown arch {arch!r}")
    kw.update(overrides)
    if arch == "qwen3_5" and "layer_types" not in overrides:
        kw["layer_types"] = _default_layer_types(kw["num_hidden_layers"])
    return kw


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise with large weights so greedy logits are well separated.

    Text weights are drawn first, in module order, from their own generator, so the "text" and "vl" layouts
    with the same seed hold identical language-model weights. A_log / dt_bias keep transformers' distributions.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    for _, module in sorted(model.named_modules(), key=lambda nm: ".visual" in f".{nm[0]}"):  # stable: text first
        cls = type(module).__name__
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d)):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.2)
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.02)
        elif cls in ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3RMSNorm"):
            # Qwen3_5RMSNorm computes x * (1 + w); the others compute x * w.
            centre = 0.0 if cls == "Qwen3_5RMSNorm" else 1.0
            module.weight.copy_(centre + 0.1 * torch.randn(module.weight.shape, generator=gen))
        elif cls == "Qwen3_5GatedDeltaNet":
            module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.01, 16, generator=gen).log())
            module.dt_bias.fill_(1.0)


def _mtp_tensors(text_cfg, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """MTP head tensors named as in released Qwen3.5 checkpoints (one full-attention decoder layer)."""
    h, d, i = text_cfg.hidden_size, text_cfg.head_dim, text_cfg.intermediate_size
    nq, nkv = text_cfg.num_attention_heads, text_cfg.num_key_value_heads
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nq * d, h),  # query + output gate, as in the target
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * d, h),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * d, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, nq * d),
        "mtp.layers.0.mlp.gate_proj.weight": (i, h),
        "mtp.layers.0.mlp.up_proj.weight": (i, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, i),
    }
    norms = {
        "mtp.pre_fc_norm_embedding.weight": h, "mtp.pre_fc_norm_hidden.weight": h,
        "mtp.layers.0.self_attn.q_norm.weight": d, "mtp.layers.0.self_attn.k_norm.weight": d,
        "mtp.layers.0.input_layernorm.weight": h, "mtp.layers.0.post_attention_layernorm.weight": h,
        "mtp.norm.weight": h,
    }
    gen = torch.Generator().manual_seed(seed + 2)
    out = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    out.update({k: torch.randn(n, generator=gen) * 0.1 for k, n in norms.items()})
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def write_dflash_drafter(out_dir, target_dir, *, block_size: int = 4, num_layers: int = 2,
                         target_layer_ids: list[int] | None = None, seed: int = 0,
                         **overrides) -> pathlib.Path:
    """A random DFlash drafter for the target in `target_dir`, in the z-lab checkpoint layout."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    text = target.get("text_config", target)
    n_target = text["num_hidden_layers"]
    ids = target_layer_ids if target_layer_ids is not None else sorted({0, n_target // 2, n_target - 2})
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
           "hidden_size": text["hidden_size"], "intermediate_size": 96, "num_hidden_layers": num_layers,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "vocab_size": text["vocab_size"], "num_target_layers": n_target,
           "dflash_config": {"mask_token_id": 1, "target_layer_ids": ids}, "dtype": "float32"}
    cfg.update(overrides)
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gen = torch.Generator().manual_seed(seed + 3)
    tensors = {"fc.weight": (h, len(ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(num_layers):
        p = f"layers.{layer}."
        tensors |= {p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
                    p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)}
    weights = {name: (1.0 + 0.1 * torch.randn(shape, generator=gen)) if len(shape) == 1
               else 0.2 * torch.randn(shape, generator=gen) for name, shape in tensors.items()}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def write_checkpoint(
    out_dir, arch: str, *, layout: str = "text", seed: int = 0, dtype: torch.dtype = torch.float32,
    mtp: bool = False, **overrides,
) -> pathlib.Path:
    """Write tokenizer + tiny random model ("qwen3", or "qwen3_5" with layout "text"/"vl") into out_dir."""
    out = pathlib.Path(out_dir)
    tok = train_tokenizer(out)
    if layout not in ("text", "vl") or (layout == "vl" and arch != "qwen3_5"):
        raise ValueError(f"unsupported layout {layout!r} for arch {arch!r}")
    if mtp and arch != "qwen3_5":
        raise ValueError("mtp=True is only supported for qwen3_5")
    text_kw = _text_config_kwargs(arch, tok.get_vocab_size(), tok.token_to_id(EOS), overrides)
    torch.manual_seed(seed)
    if arch == "qwen3":
        config = transformers.Qwen3Config(**text_kw)
        model = transformers.Qwen3ForCausalLM(config)
    elif layout == "text":
        config = transformers.Qwen3_5TextConfig(**text_kw)
        model = transformers.Qwen3_5ForCausalLM(config)
    else:
        vision = dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text_kw["hidden_size"],
            patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
        )
        config = transformers.Qwen3_5Config(
            text_config=text_kw, vision_config=vision,
            tie_word_embeddings=text_kw["tie_word_embeddings"], eos_token_id=text_kw["eos_token_id"],
        )
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    _reinit(model, seed)
    if text_kw["tie_word_embeddings"]:
        model.tie_weights()
    model.to(dtype).eval()
    model.save_pretrained(out, safe_serialization=True)
    if mtp:
        text_cfg = config.get_text_config()
        weights_path = out / "model.safetensors"
        tensors = load_file(str(weights_path))
        tensors.update(_mtp_tensors(text_cfg, dtype, seed))
        save_file(tensors, str(weights_path), metadata={"format": "pt"})
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        (cfg["text_config"] if layout == "vl" else cfg)["mtp_num_hidden_layers"] = 1
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


@functools.lru_cache(maxsize=None)
def _load(model_dir: str) -> torch.nn.Module:
    # AutoModelForCausalLM maps the "qwen3_5" (vl) layout to Qwen3_5ForCausalLM, stripping "language_model".
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def reference_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation from transformers; always exactly max_new_tokens new ids (EOS ignored).
    Computed once per checkpoint, prompt and length in a session (many tests share them)."""
    return list(_greedy(str(pathlib.Path(model_dir).resolve()), tuple(prompt_ids), max_new_tokens))


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _greedy(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _load(model_dir)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
        temperature=None, top_p=None, top_k=None,
    )
    return tuple(out[0, ids.shape[1]:].tolist())


@torch.no_grad()
def reference_logits(model_dir, prompt_ids: list[int]) -> torch.Tensor:
    """Float32 prefill logits [len(prompt_ids), vocab] from transformers."""
    model = _load(str(pathlib.Path(model_dir).resolve()))
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].float()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3_5"])
    parser.add_argument("--layout", default="text", choices=["text", "vl"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--mtp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write_checkpoint(
        args.out_dir, args.arch, layout=args.layout, seed=args.seed, dtype=getattr(torch, args.dtype), mtp=args.mtp
    )
    print(path)
