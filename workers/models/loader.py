"""Loads a Hugging Face checkpoint directory (config.json + safetensors) into a metrale model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from metrale.workers.models.config import CheckpointError, ModelConfig
from metrale.workers.models.decoder import CausalLM
from metrale.workers.models.parallel import SINGLE, check_divisible, model_shards
from metrale.workers.parallel import TensorParallel

_LANGUAGE_PREFIX = {"text": "model.", "vl": "model.language_model."}
_IGNORED_PREFIXES = ("model.visual.",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir / 'model.safetensors'}: missing (no safetensors weights)")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {index.name})")
    return files


def read_tensors(model_dir: Path, device: torch.device, dtype: torch.dtype,
                 take=None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint; `take(file, name)` reads one (part of it: a rank's shard)."""
    tensors = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if not name.startswith(_IGNORED_PREFIXES):
                        t = take(f, name) if take else f.get_tensor(name)
                        tensors[name] = t.to(device=device, dtype=dtype)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors ({e})") from e
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: corrupt safetensors file ({type(e).__name__}: {e})") from e
    return tensors


def load_model(model_dir: str | Path, device: torch.device | str = "cpu", dtype: str = "auto",
               tp: TensorParallel = SINGLE) -> tuple[CausalLM, dict[str, torch.Tensor]]:
    """Returns the target model (this rank's shard of it) and the checkpoint's `mtp.*` tensors
    (empty when it has none; whole on every rank)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: no such model directory")
    cfg = ModelConfig.from_dir(model_dir, dtype)
    check_divisible(cfg, tp.size)
    device = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(cfg, tp)
    prefix = _LANGUAGE_PREFIX[cfg.layout]

    def state_name(name: str) -> str:
        return "model." + name[len(prefix):] if name.startswith(prefix) else name

    shapes, shards = {k: v.shape for k, v in model.state_dict().items()}, model_shards(model)

    def take(f, name: str) -> torch.Tensor:
        """A split weight: only this rank's share is read, after checking the whole shape."""
        key = state_name(name)
        if key not in shards:
            return f.get_tensor(name)
        part = f.get_slice(name)
        full, want = tuple(part.get_shape()), shards[key].full_shape(shapes[key])
        if full != want:
            raise CheckpointError(f"{model_dir}: tensor {key} has shape {full}, config.json "
                                  f"implies {want}")
        return shards[key].take(part.__getitem__, tp)

    tensors = read_tensors(model_dir, device, cfg.dtype, take)
    state, mtp = {}, {}
    for name, t in tensors.items():
        if name.startswith("mtp."):
            mtp[name] = t
        else:
            state[state_name(name)] = t
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(f"{model_dir}: weights do not match config.json "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for name, t in state.items():
        want = model.state_dict()[name].shape
        if t.shape != want:
            raise CheckpointError(f"{model_dir}: tensor {name} has shape {tuple(t.shape)}, "
                                  f"config.json implies {tuple(want)}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = type(model.model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    return model.eval(), mtp


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir}: no such model directory")
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (metrale reads the tokenizer from tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from e
