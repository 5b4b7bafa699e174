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

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from metrale.drafting.dflash import DFlashDrafter, block_mask
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
    target_weight_decay: float = 0.1
    # Drafters learn from the target's own continuations (self-distillation): `rollouts` sequences
    # of `seq_len` tokens, each a training-text prompt of `rollout_prompt` tokens continued by the
    # target; every other batch samples its first `rollout_sampled` tokens at T=1 (then greedy),
    # so that the target leaves text it has memorised, as it does on unseen prompts.
    rollouts: int = 12288
    rollout_batch: int = 4096
    rollout_prompt: int = 128
    rollout_sampled: int = 8
    mtp_steps: int = 3000
    dflash_steps: int = 4000
    drafter_lr: float = 1e-3
    dflash_block: int = 8
    dflash_layers: int = 4
    dflash_layer_ids: tuple[int, ...] = (1, 3, 5, 7)
    dflash_anchors: int = 32          # blocks trained per sequence
    dflash_decay: float = 0.7         # loss weight of block position i: decay ** i
    heldout_every: int = 20           # one file in this many (by path hash) is held out
    max_files: int | None = None      # smoke tests train on a few files
    seed: int = 0
    device: str = "auto"
    # stage -> seconds: a stage stops early past its budget, its learning rate decayed by then
    # (the log records the steps that ran); None: every step runs, and the build is deterministic
    stage_seconds: dict[str, float] | None = None

    @classmethod
    def tiny(cls, out: Path) -> "TrainConfig":
        """A configuration that trains in seconds on a CPU (the CI smoke test)."""
        return cls(out, vocab_size=320, hidden_size=32, num_layers=4, intermediate_size=64,
                   heads=2, kv_heads=1, head_dim=16, linear_key_heads=2, linear_value_heads=2,
                   linear_head_dim=8, seq_len=64, batch=4, target_steps=3, mtp_steps=2,
                   dflash_steps=2, dflash_block=4, dflash_layers=1, dflash_layer_ids=(0, 3),
                   dflash_anchors=2, rollouts=6, rollout_batch=4, rollout_prompt=16,
                   rollout_sampled=4, max_files=8, heldout_every=3, device="cpu")


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


def prepare_data(cfg: TrainConfig, target_dir: Path,
                 data_path: Path) -> tuple[Tokenizer, torch.Tensor]:
    """The `data` stage: tokenizer, held-out manifest and the encoded training files, written so
    that later stages can run on a machine whose interpreter has another standard library."""
    train_files, held_files, root = stdlib_files(cfg)
    tok = build_tokenizer((read_text(f) for f in train_files), cfg.vocab_size)
    tokens = encode_files(tok, train_files)
    target_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(target_dir / "tokenizer.json"))
    (target_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "mask_token": MASK,
         "model_max_length": 4096}, indent=2) + "\n")
    manifest = {"stdlib": str(root), "python": sysconfig.get_python_version(),
                "heldout_every": cfg.heldout_every,
                "heldout": [str(f.relative_to(root)) for f in held_files],
                "train_files": len(train_files), "train_tokens": len(tokens)}
    (target_dir / "heldout.json").write_text(json.dumps(manifest, indent=1) + "\n")
    data_path.parent.mkdir(parents=True, exist_ok=True)
    tokens.numpy().astype(np.uint16).tofile(data_path)     # vocabularies stay below 65536
    return tok, tokens


def load_data(target_dir: Path, data_path: Path) -> tuple[Tokenizer, torch.Tensor]:
    """What the `data` stage wrote: the tokenizer and the encoded training files."""
    if not data_path.is_file():
        raise FileNotFoundError(f"{data_path} is missing: run the 'data' stage first")
    tokens = torch.from_numpy(np.fromfile(data_path, dtype=np.uint16).astype(np.int64))
    return Tokenizer.from_file(str(target_dir / "tokenizer.json")), tokens


def sample_batch(tokens: torch.Tensor, cfg: TrainConfig, gen: torch.Generator, device):
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
    return torch.stack([tokens[s:s + cfg.seq_len] for s in starts.tolist()]).to(device)


def lr_at(step: int, steps: int, peak: float, clock: "StageClock | None" = None) -> float:
    """Linear warm-up over the first 5%, then a cosine to zero at the last step, or at the end
    of the stage's time budget when that comes first."""
    warmup = max(steps // 20, 1)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    if clock is not None:
        progress = max(progress, clock.fraction())
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


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
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.target_lr,
                            weight_decay=cfg.target_weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    clock = StageClock("target", cfg)
    for step in range(cfg.target_steps):
        if clock.over(step):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.target_steps, cfg.target_lr, clock)
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
        # float32, as the evaluation runs: the drafters learn the greedy tokens it will see
        logits = self.model(input_ids=ids).logits
        last = len(self.model.model.layers) - 1
        return self.outputs[last], [self.outputs[i] for i in self.capture], logits.argmax(-1)


# -- what the drafters learn from: the target's own continuations ----------------------------------

@dataclass
class Rollouts:
    """Sequences the target continued, with what it computed on them. ids, greedy: [N, L];
    hidden and each of captured: [N, L, H]; greedy[:, p] is the target's argmax after ids[:, :p+1],
    the token a drafter should propose there."""
    ids: torch.Tensor
    hidden: torch.Tensor
    captured: list[torch.Tensor]
    greedy: torch.Tensor

    def sample(self, size: int, gen: torch.Generator):
        rows = torch.randint(0, len(self.ids), (size,), generator=gen).to(self.ids.device)
        return (self.ids[rows], self.hidden[rows].float(), [c[rows].float() for c in self.captured],
                self.greedy[rows])


def make_rollouts(cfg: TrainConfig, target, tokens: torch.Tensor, device) -> Rollouts:
    """Training-text prompts continued by the target to `seq_len` tokens, then run through the
    target once more to record its hidden states, captured layers and greedy tokens."""
    gen = torch.Generator().manual_seed(cfg.seed + 6)
    clock = StageClock("rollouts", cfg)
    batches = []
    for b in range(-(-cfg.rollouts // cfg.rollout_batch)):
        if batches and clock.over(b):
            break
        size = min(cfg.rollout_batch, cfg.rollouts - b * cfg.rollout_batch)
        starts = torch.randint(0, len(tokens) - cfg.rollout_prompt, (size,), generator=gen)
        ids = torch.stack([tokens[s:s + cfg.rollout_prompt] for s in starts.tolist()]).to(device)
        if b % 2 == 1 and cfg.rollout_sampled:
            torch.manual_seed(cfg.seed + 7 + b)
            ids = _continue(target, ids, cfg.rollout_sampled, sample=True)
        batches.append(_continue(target, ids, cfg.seq_len - ids.shape[1], sample=False))
        log.warning("rollouts: batch %d of %d sequences done", b + 1, size)
    ids = torch.cat(batches)
    tap = TargetTap(target, cfg.dflash_layer_ids)
    store = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (len(ids), cfg.seq_len, target.config.hidden_size)
    hidden = torch.empty(shape, dtype=store, device=device)
    captured = [torch.empty(shape, dtype=store, device=device) for _ in cfg.dflash_layer_ids]
    greedy = torch.empty(len(ids), cfg.seq_len, dtype=torch.long, device=device)
    for i in range(0, len(ids), cfg.batch):
        h, caps, g = tap(ids[i:i + cfg.batch])
        hidden[i:i + cfg.batch], greedy[i:i + cfg.batch] = h, g
        for buf, c in zip(captured, caps):
            buf[i:i + cfg.batch] = c
    clock.over(len(batches))
    agree = (greedy[:, cfg.rollout_prompt - 1:-1] == ids[:, cfg.rollout_prompt:]).float().mean()
    log.warning("rollouts: %d sequences; the continuations are the target's greedy tokens at "
                "%.3f of positions", len(ids), float(agree))
    return Rollouts(ids, hidden, captured, greedy)


@torch.no_grad()
def _continue(target, ids: torch.Tensor, count: int, sample: bool) -> torch.Tensor:
    """ids [B, n] -> [B, n + count]: the target's continuation, greedy or sampled at T=1."""
    how = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else \
        {"do_sample": False}
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                           min_new_tokens=count, pad_token_id=0, **how)


# -- MTP -------------------------------------------------------------------------------------

def train_mtp(cfg: TrainConfig, target, data: Rollouts, device) -> MTPHead:
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
    clock = StageClock("mtp", cfg)
    for step in range(cfg.mtp_steps):
        if clock.over(step):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.mtp_steps, cfg.drafter_lr, clock)
        ids, hidden, _, greedy = data.sample(cfg.batch, gen)
        n = cfg.seq_len - chain - 1
        batch = _whole_sequences(cfg.batch, n, device)
        h, loss = hidden[:, :n].reshape(-1, hidden.shape[-1]), 0.0
        for s in range(chain):
            # row p: token p+1+s, and step s-1's output at p (the target's hidden for s = 0)
            tok_in = ids[:, 1 + s:1 + s + n].reshape(-1)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                h = head(embed, rotary, tok_in, h, batch, None)
                logits = F.linear(head.norm(h), embed.weight).float()
            # a later draft counts only when all before it were accepted
            loss = loss + F.cross_entropy(logits, greedy[:, 1 + s:1 + s + n].reshape(-1)) * 0.7 ** s
        _optimise(opt, head, loss)
        _report("mtp", step, cfg.mtp_steps, loss)
    else:
        clock.over(cfg.mtp_steps)
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


def train_dflash(cfg: TrainConfig, target, data: Rollouts, device):
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
    weights = torch.tensor([cfg.dflash_decay ** i for i in range(g - 1)], device=device)
    clock = StageClock("dflash", cfg)
    for step in range(cfg.dflash_steps):
        if clock.over(step):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.dflash_steps, cfg.drafter_lr, clock)
        ids, _, captured, greedy = data.sample(cfg.batch, gen)
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
            mask = block_mask(ctx_mask.flatten(0, 1), g)                             # [B*nb, 1, 1, L+g]
            x = embed(block).flatten(0, 1)                                           # [B*nb, g, H]
            for layer in drafter.layers:
                k, v = layer.keys_values(feats, ctx_cs)                              # [B, L, kv, d]
                k = k.repeat_interleave(nb, dim=0)
                v = v.repeat_interleave(nb, dim=0)
                x = layer(x, blk_cs, k, v, mask)
            logits = F.linear(drafter.norm(x[:, 1:]), embed.weight).float()        # [B*nb, g-1, V]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (ce.view(-1, g - 1) * weights).sum(-1).mean() / weights.sum()
        _optimise(opt, drafter, loss)
        _report("dflash", step, cfg.dflash_steps, loss)
    else:
        clock.over(cfg.dflash_steps)
    return drafter.eval(), dcfg


class StageClock:
    """Times a stage and stops it once its budget (if any) is spent; records the steps run."""
    runs: dict[str, "StageClock"] = {}

    def __init__(self, stage: str, cfg: TrainConfig):
        self.seconds = (cfg.stage_seconds or {}).get(stage)
        self.start, self.elapsed, self.steps_run = time.time(), 0.0, 0
        StageClock.runs[stage] = self

    def over(self, step: int) -> bool:
        self.steps_run, self.elapsed = step, time.time() - self.start
        return self.seconds is not None and self.elapsed > self.seconds

    def fraction(self) -> float:
        """How much of the time budget is spent (0 without one)."""
        return self.elapsed / self.seconds if self.seconds else 0.0


def _optimise(opt: torch.optim.Optimizer, module: torch.nn.Module, loss: torch.Tensor) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _report(stage: str, step: int, steps: int, loss) -> None:
    if step % 50 == 0 or step == steps - 1:
        log.warning("%s step %d/%d loss %.4f", stage, step + 1, steps, float(loss.detach()))


# -- the whole build ------------------------------------------------------------------------------

STAGES = ("data", "target", "mtp", "dflash")


def build(cfg: TrainConfig, stages: tuple[str, ...] = STAGES) -> dict:
    """Runs the given stages and writes `out/target` (with mtp.* tensors) and `out/dflash`.
    `data` writes the tokenizer, the held-out manifest and `out/data/train_tokens.u16`, which
    the other stages read. Drafter stages train on the target as saved (bfloat16), loading it
    when not trained now, and on its continuations of training prompts."""
    import transformers
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if cfg.device == "auto" else cfg.device)
    target_dir, dflash_dir = cfg.out / "target", cfg.out / "dflash"
    data_path = cfg.out / "data" / "train_tokens.u16"
    log_path = cfg.out / "training.json"
    # the log of a build starts with its data stage; later stages append their runs
    info = json.loads(log_path.read_text()) if log_path.exists() and "data" not in stages else {}
    started = time.time()
    StageClock.runs.clear()
    if "data" in stages:
        clock = StageClock("data", cfg)
        tok, tokens = prepare_data(cfg, target_dir, data_path)
        clock.over(1)
    else:
        tok, tokens = load_data(target_dir, data_path)
    manifest = json.loads((target_dir / "heldout.json").read_text())
    log.warning("corpus: %d training files, %d held out, %d training tokens",
                manifest["train_files"], len(manifest["heldout"]), len(tokens))
    if "target" in stages:
        target = train_target(cfg, tok, tokens, device)
        target.to(torch.bfloat16).save_pretrained(target_dir, max_shard_size="12MB")
        info["target_parameters"] = sum(p.numel() for p in target.parameters())
    if "mtp" in stages or "dflash" in stages:
        target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        target = target.to(device).eval().requires_grad_(False)
        data = make_rollouts(cfg, target, tokens, device)
    if "mtp" in stages:
        mtp = train_mtp(cfg, target, data, device)
        _add_mtp(target_dir, {f"mtp.{k}": v for k, v in mtp.state_dict().items()})
        info["mtp_parameters"] = sum(p.numel() for p in mtp.parameters())
    if "dflash" in stages:
        drafter, dcfg = train_dflash(cfg, target, data, device)
        dflash_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()},
                  str(dflash_dir / "model.safetensors"), metadata={"format": "pt"})
        (dflash_dir / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")
        info["dflash_parameters"] = sum(p.numel() for p in drafter.parameters())
    info["corpus"] = {"python": manifest["python"], "train_files": manifest["train_files"],
                      "heldout_files": len(manifest["heldout"]), "train_tokens": len(tokens)}
    info.setdefault("runs", []).append({
        "stages": list(stages), "seconds": round(time.time() - started, 1),
        "steps": {s: c.steps_run for s, c in StageClock.runs.items()},
        "stage_seconds": {s: round(c.elapsed, 1) for s, c in StageClock.runs.items()},
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {k: (str(v) if isinstance(v, Path) else v)
                   for k, v in dataclasses.asdict(cfg).items()}})
    log_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


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
