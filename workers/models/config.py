"""The model configuration metrale reads from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Architecture name in config.json -> (metrale family, layout of the language weights).
ARCHITECTURES = {
    "Qwen3ForCausalLM": ("qwen3", "text"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "text"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "vl"),
}
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
               "qwen3_5": "Qwen3_5ForConditionalGeneration"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that metrale cannot load; the message names the file or field."""


def read_json(path: Path, needed_by: str) -> dict:
    """A checkpoint's JSON file; CheckpointError naming the file when it is missing or corrupt."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({needed_by} needs {path.name})")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


@dataclass(frozen=True)
class ModelConfig:
    family: str                      # "qwen3" or "qwen3_5"
    layout: str                      # "text" (weights under model.*) or "vl" (model.language_model.*)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    # Gated DeltaNet (Qwen3.5 linear attention)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    mtp_num_hidden_layers: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str = "auto") -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        return cls.from_dict(read_json(path, "a Hugging Face checkpoint"), dtype, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, dtype: str = "auto", source: str = "config.json") -> "ModelConfig":
        arch = (raw.get("architectures") or [MODEL_TYPES.get(raw.get("model_type"), "")])[0]
        if arch not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise CheckpointError(
                f"{source}: architecture {arch or raw.get('model_type')!r} is not supported; "
                f"metrale supports {supported}")
        family, layout = ARCHITECTURES[arch]
        text = raw.get("text_config", raw) if layout == "vl" else raw
        return cls._from_text(text, raw, family, layout, dtype, source)

    @classmethod
    def _from_text(cls, t: dict, top: dict, family: str, layout: str, dtype: str,
                   source: str) -> "ModelConfig":
        def need(key):
            if key not in t:
                raise CheckpointError(f"{source}: required field {key!r} is missing")
            return t[key]

        rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor",
                                                          0.25 if family == "qwen3_5" else 1.0))
        if t.get("use_sliding_window"):
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        n_layers = need("num_hidden_layers")
        if family == "qwen3_5":
            interval = t.get("full_attention_interval", 4)
            default_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                             for i in range(n_layers)]
        else:
            default_types = ["full_attention"] * n_layers
        layer_types = tuple(t.get("layer_types") or default_types)
        unknown = set(layer_types) - {"full_attention", "linear_attention"}
        if unknown or len(layer_types) != n_layers:
            raise CheckpointError(f"{source}: layer_types {sorted(unknown) or len(layer_types)} "
                                  f"do not fit num_hidden_layers={n_layers}")
        eos = t.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        tie = top.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
        heads = need("num_attention_heads")
        return cls(
            family=family, layout=layout,
            vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"), num_hidden_layers=n_layers,
            num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
            head_dim=t.get("head_dim") or need("hidden_size") // heads,
            rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=t.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(tie), attention_bias=bool(t.get("attention_bias", False)),
            layer_types=layer_types, dtype=_resolve_dtype(dtype, t, top, source),
            eos_token_ids=eos_ids,
            linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=t.get("linear_key_head_dim", 0),
            linear_value_head_dim=t.get("linear_value_head_dim", 0),
            linear_num_key_heads=t.get("linear_num_key_heads", 0),
            linear_num_value_heads=t.get("linear_num_value_heads", 0),
            mtp_num_hidden_layers=t.get("mtp_num_hidden_layers", 0),
            extra={"raw": top},
        )


def _resolve_dtype(requested: str, text: dict, top: dict, source: str) -> torch.dtype:
    if requested != "auto":
        if requested not in DTYPES:
            raise CheckpointError(f"dtype {requested!r} is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[requested]
    name = text.get("dtype") or text.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype")
    name = name or "float32"
    if name not in DTYPES:
        raise CheckpointError(f"{source}: dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]
