"""Builds the bundled demo model from scratch: tokenizer, Qwen3.5 target, MTP layer, DFlash drafter."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from metrale.drafting.dflash import DFlashDrafter
from metrale.drafting.mtp import MTPHead
from metrale.workers.batch import ForwardBatch
from metrale.workers.models.config import ModelConfig
from metrale.workers.models.layers import Rotary

log = logging.getLogger(__name__)

EOS, MASK = "<|endoftext|>", "<|mask|>"
# How released Qwen tokenizers split text before byte-level BPE (transformers' Qwen3.5 tokenizer
# applies the same split and NFC, so `tokenizer.json` encodes as AutoTokenizer does).
SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
               r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 8               # full attention every 4th layer, Gated DeltaNet otherwise
    intermediate_size: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_head_dim: int = 32
    seq_len: int = 512
    batch: int = 64
    target_steps: int = 2000
    target_lr: float = 2e-3
    mtp_steps: int = 3000
    dflash_steps: int = 4000
    drafter_lr: float = 1e-3
    dflash_block: int = 8
    dflash_layers: int = 3
    dflash_layer_ids: tuple[int, ...] = (1, 4, 6)
    dflash_anchors: int = 32          # blocks trained per sequence
    heldout_every: int = 20           # one file in this many (by path hash) is held out
    max_files: int | None = None      # smoke tests train on a few files
    seed: int = 0
    device: str = "auto"
    stage_seconds: float | None = None  # stop a stage early past this (the log records the steps)

    @classmethod
    def tiny(cls, out: Path) -> "TrainConfig":
        """A configuration that trains in seconds on a CPU (the CI smoke test)."""
        return cls(out, vocab_size=320, hidden_size=32, num_layers=4, intermediate_size=64,
                   heads=2, kv_heads=1, head_dim=16, linear_key_heads=2, linear_value_heads=2,
                   linear_head_dim=8, seq_len=64, batch=4, target_steps=3, mtp_steps=2,
                   dflash_steps=2, dflash_block=4, dflash_layers=1, dflash_layer_ids=(0, 2),
                   dflash_anchors=2, max_files=8, heldout_every=3, device="cpu")


# -- data -------------------------------------------------------------------------------------

def stdlib_files(cfg: TrainConfig) -> tuple[list[Path], list[Path], Path]:
    """The running interpreter's standard-library sources, split by a hash of each path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts)
    if cfg.max_files:
        files = files[:cfg.max_files]
    held = [f for f in files if _path_hash(f.relative_to(root)) % cfg.heldout_every == 0]
    train = [f for f in files if f not in set(held)]
    return train, held, root


def _path_hash(rel: Path) -> int:
    return int(hashlib.sha256(str(rel).encode()).hexdigest()[:8], 16)


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the Qwen split, an end-of-text token (id 0) and a mask token (id 1)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_files(tok: Tokenizer, files: list[Path]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([read_text(f) for f in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(tokens: torch.Tensor, cfg: TrainConfig, gen: torch.Generator, device):
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
    return torch.stack([tokens[s:s + cfg.seq_len] for s in starts.tolist()]).to(device)


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(steps // 20, 1)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


# -- the target ---------------------------------------------------------------------------------

def target_config(cfg: TrainConfig, tok: Tokenizer):
    import transformers
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                   for i in range(cfg.num_layers)]
    return transformers.Qwen3_5TextConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_key_heads, linear_num_value_heads=cfg.linear_value_heads,
        linear_key_head_dim=cfg.linear_head_dim, linear_value_head_dim=cfg.linear_head_dim,
        linear_conv_kernel_dim=4, layer_types=layer_types, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=tok.token_to_id(EOS), bos_token_id=None,
        pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def train_target(cfg: TrainConfig, tok: Tokenizer, tokens: torch.Tensor, device) -> torch.nn.Module:
    import transformers
    torch.manual_seed(cfg.seed)
    model = transformers.Qwen3_5ForCausalLM(target_config(cfg, tok)).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.target_lr, weight_decay=0.1,
                            betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    clock = StageClock("target", cfg.stage_seconds)
    for step in range(cfg.target_steps):
        if clock.over(step):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.target_steps, cfg.target_lr)
        ids = sample_batch(tokens, cfg, gen, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        _optimise(opt, model, loss)
        _report("target", step, cfg.target_steps, loss)
    else:
        clock.steps_run = cfg.target_steps
    return model.eval()


class TargetTap:
    """Runs the frozen target and keeps what the drafters learn from: the last layer's hidden
    state before the final norm, the outputs of the DFlash capture layers, and its greedy tokens."""

    def __init__(self, model, capture: tuple[int, ...]):
        self.model, self.capture, self.outputs = model, capture, {}
        layers = model.model.layers
        for i in set(capture) | {len(layers) - 1}:
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i):
        def keep(module, args, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return keep

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
            logits = self.model(input_ids=ids).logits
        last = len(self.model.model.layers) - 1
        return (self.outputs[last].float(), [self.outputs[i].float() for i in self.capture],
                logits.argmax(-1))


# -- MTP -------------------------------------------------------------------------------------

def train_mtp(cfg: TrainConfig, target, tap: TargetTap, tokens: torch.Tensor, device) -> MTPHead:
    """Trains metrale's own MTP head on the frozen target. Step s of the chain reads the token s
    places ahead and the previous step's output (the target's hidden for step 1), and learns the
    target's greedy token, which is what the verify compares its draft with."""
    mcfg = dataclasses.replace(ModelConfig.from_dict(target.config.to_dict(), "float32"),
                               mtp_num_hidden_layers=1)
    torch.manual_seed(cfg.seed + 2)
    head = MTPHead(mcfg).to(device)
    embed = target.model.embed_tokens
    rotary = Rotary(mcfg.rotary_dim, mcfg.rope_theta).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.drafter_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    chain = 3
    clock = StageClock("mtp", cfg.stage_seconds)
    for step in range(cfg.mtp_steps):
        if clock.over(step):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.mtp_steps, cfg.drafter_lr)
        ids = sample_batch(tokens, cfg, gen, device)
        hidden, _, greedy = tap(ids)
        n = cfg.seq_len - chain - 1
        batch = _whole_sequences(cfg.batch, n, device)
        h, loss = hidden[:, :n].reshape(-1, hidden.shape[-1]), 0.0
        for s in range(chain):
            # row p: token p+1+s, and step s-1's output at p (the target's hidden for s = 0)
            tok_in = ids[:, 1 + s:1 + s + n].reshape(-1)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                h = head(embed, rotary, tok_in, h, batch, None)
                logits = F.linear(head.norm(h), embed.weight).float()
            loss = loss + F.cross_entropy(logits, greedy[:, 1 + s:1 + s + n].reshape(-1)) / 2 ** s
        _optimise(opt, head, loss)
        _report("mtp", step, cfg.mtp_steps, loss)
    else:
        clock.steps_run = cfg.mtp_steps
    return head.eval()


def _whole_sequences(count: int, length: int, device) -> ForwardBatch:
    """A batch of `count` sequences of `length` rows each, from position 0, with no cache."""
    return ForwardBatch.build([([0] * length, 0, [0], -1) for _ in range(count)], length, device)


# -- DFlash -------------------------------------------------------------------------------------

def dflash_config(cfg: TrainConfig, target) -> dict:
    tc = target.config
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "block_size": cfg.dflash_block, "hidden_size": tc.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.dflash_layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "vocab_size": tc.vocab_size, "num_target_layers": tc.num_hidden_layers,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16",
            "dflash_config": {"mask_token_id": 1, "target_layer_ids": list(cfg.dflash_layer_ids)}}


def train_dflash(cfg: TrainConfig, target, tap: TargetTap, tokens: torch.Tensor, device):
    """Trains a DFlash drafter (metrale's own modules) on the frozen target's features: each
    block [t_a, MASK x (g-1)] sees the features of positions < a and learns the target's greedy
    tokens a+1 .. a+g-1."""
    dcfg = dflash_config(cfg, target)
    torch.manual_seed(cfg.seed + 4)
    drafter = DFlashDrafter(dcfg, len(cfg.dflash_layer_ids)).to(device)
    embed = target.model.embed_tokens
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.drafter_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 5)
    g, nb, L = cfg.dflash_block, cfg.dflash_anchors, cfg.seq_len
    # later draft positions matter less: a draft only counts when all before it were accepted
    weights = torch.tensor([0.8 ** i for i in range(g - 1)], device=device)
    clock = StageClock("dflash", cfg.stage_seconds)
    for step in range(cfg.dflash_steps):
        if clock.over(step):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.dflash_steps, cfg.drafter_lr)
        ids = sample_batch(tokens, cfg, gen, device)
        _, captured, greedy = tap(ids)
        anchors = torch.randint(1, L - g, (cfg.batch, nb), generator=gen).to(device)  # [B, nb]
        offs = torch.arange(g, device=device)
        block_pos = anchors[..., None] + offs                                        # [B, nb, g]
        block = torch.full_like(block_pos, 1)
        block[..., 0] = ids.gather(1, anchors)
        labels = greedy.gather(1, (block_pos[..., 1:] - 1).flatten(1)).view(cfg.batch, nb, g - 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            feats = drafter.hidden_norm(drafter.fc(torch.cat(captured, -1)))        # [B, L, H]
            ctx_cs = drafter.rotary.cos_sin(torch.arange(L, device=device), feats.dtype)
            blk_cs = tuple(t.view(cfg.batch * nb, g, 1, -1) for t in
                           drafter.rotary.cos_sin(block_pos.flatten(), feats.dtype))
            ctx_mask = (torch.arange(L, device=device)[None, None, :] < anchors[..., None])
            ctx_mask = ctx_mask.flatten(0, 1)                                        # [B*nb, L]
            x = embed(block).flatten(0, 1)                                           # [B*nb, g, H]
            for layer in drafter.layers:
                k, v = layer.keys_values(feats, ctx_cs)                              # [B, L, kv, d]
                k = k.repeat_interleave(nb, dim=0)
                v = v.repeat_interleave(nb, dim=0)
                x = layer(x, blk_cs, k, v, ctx_mask)
            logits = F.linear(drafter.norm(x[:, 1:]), embed.weight).float()        # [B*nb, g-1, V]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (ce.view(-1, g - 1) * weights).sum(-1).mean() / weights.sum()
        _optimise(opt, drafter, loss)
        _report("dflash", step, cfg.dflash_steps, loss)
    else:
        clock.steps_run = cfg.dflash_steps
    return drafter.eval(), dcfg


class StageClock:
    """Stops a stage once its time budget is spent; `steps_run` records how far it got."""
    runs: dict[str, "StageClock"] = {}

    def __init__(self, stage: str, seconds: float | None):
        self.stage, self.seconds, self.start, self.steps_run = stage, seconds, time.time(), 0
        StageClock.runs[stage] = self

    def over(self, step: int) -> bool:
        self.steps_run = step
        return self.seconds is not None and time.time() - self.start > self.seconds


def _optimise(opt: torch.optim.Optimizer, module: torch.nn.Module, loss: torch.Tensor) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _report(stage: str, step: int, steps: int, loss) -> None:
    if step % 50 == 0 or step == steps - 1:
        log.warning("%s step %d/%d loss %.4f", stage, step + 1, steps, float(loss))


# -- the whole build ------------------------------------------------------------------------------

STAGES = ("target", "mtp", "dflash")


def build(cfg: TrainConfig, stages: tuple[str, ...] = STAGES) -> dict:
    """Trains the given stages and writes `out/target` (with mtp.* tensors) and `out/dflash`.
    Drafter stages train on the target as saved (bfloat16), loading it when not trained now."""
    import transformers
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if cfg.device == "auto" else cfg.device)
    target_dir, dflash_dir = cfg.out / "target", cfg.out / "dflash"
    log_path = cfg.out / "training.json"
    info = json.loads(log_path.read_text()) if log_path.exists() and "target" not in stages else {}
    started = time.time()
    train_files, held_files, root = stdlib_files(cfg)
    if "target" in stages:
        tok = build_tokenizer((read_text(f) for f in train_files), cfg.vocab_size)
    else:
        tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    tokens = encode_files(tok, train_files)
    log.warning("corpus: %d training files, %d held out, %d training tokens",
                len(train_files), len(held_files), len(tokens))
    if "target" in stages:
        target = train_target(cfg, tok, tokens, device)
        save_target(target, tok, target_dir, root, held_files, cfg, len(tokens))
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    target = target.to(device).eval().requires_grad_(False)
    tap = TargetTap(target, cfg.dflash_layer_ids)
    if "mtp" in stages:
        mtp = train_mtp(cfg, target, tap, tokens, device)
        _add_mtp(target_dir, {f"mtp.{k}": v for k, v in mtp.state_dict().items()})
        info["mtp_parameters"] = sum(p.numel() for p in mtp.parameters())
    if "dflash" in stages:
        drafter, dcfg = train_dflash(cfg, target, tap, tokens, device)
        dflash_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()},
                  str(dflash_dir / "model.safetensors"), metadata={"format": "pt"})
        (dflash_dir / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")
        info["dflash_parameters"] = sum(p.numel() for p in drafter.parameters())
    info["target_parameters"] = sum(p.numel() for p in target.parameters())
    info.setdefault("runs", []).append({
        "stages": list(stages), "seconds": round(time.time() - started, 1),
        "steps": {s: c.steps_run for s, c in StageClock.runs.items()},
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {k: (str(v) if isinstance(v, Path) else v)
                   for k, v in dataclasses.asdict(cfg).items()}})
    log_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


def save_target(target, tok: Tokenizer, target_dir: Path, root: Path, held_files: list[Path],
                cfg: TrainConfig, num_tokens: int) -> None:
    target.to(torch.bfloat16).save_pretrained(target_dir, max_shard_size="12MB")
    tok.save(str(target_dir / "tokenizer.json"))
    (target_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "mask_token": MASK,
         "model_max_length": 4096}, indent=2) + "\n")
    manifest = {"stdlib": str(root), "python": sysconfig.get_python_version(),
                "heldout_every": cfg.heldout_every,
                "heldout": [str(f.relative_to(root)) for f in held_files],
                "train_tokens": num_tokens}
    (target_dir / "heldout.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _add_mtp(target_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Stores the MTP layer as released Qwen3.5 checkpoints do: `mtp.*` tensors beside the
    target's, and `mtp_num_hidden_layers` in config.json."""
    path = target_dir / "model-mtp.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:   # a single file: write an index so both files are found
        single = target_dir / "model.safetensors"
        index = {"metadata": {}, "weight_map": {k: single.name for k in load_file(str(single))}}
    index["weight_map"].update({k: path.name for k in tensors})
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((target_dir / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
