"""The DFlash proposer: a block-diffusion drafter (z-lab layout) that drafts gamma-1 tokens per forward."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from metrale.drafting.proposer import (CommittedRows, HeldRows, Proposal, ProposeRequest,
                                       ProposerError, gather_rows, masked_argmax)
from metrale.workers.models.config import read_json
from metrale.workers.batch import to_device
from metrale.workers.cuda_graphs import bucket_for, buckets_up_to, capture
from metrale.workers.models import kernels
from metrale.workers.models.decoder import CausalLM, fuse
from metrale.workers.models.layers import MLP, RMSNorm, Rotary
from metrale.workers.models.loader import read_tensors


def block_mask(ctx_mask: torch.Tensor, block: int) -> torch.Tensor:
    """The attention mask of a block of `block` queries ([B, 1, 1, W + block]): the context rows
    `ctx_mask` [B, W] allows, then every row of the block (non-causal within it)."""
    whole = torch.ones(ctx_mask.shape[0], block, dtype=torch.bool, device=ctx_mask.device)
    return torch.cat((ctx_mask, whole), 1)[:, None, None, :]


class RingBlock(NamedTuple):
    """Where a block forward on the GPU reads and writes the context rings (DFlashLayer.over_ring):
    sequence i's g block rows go to rows context[i] .. + g of its slot's ring, just after the
    context rows it attends to (the ring's spare g rows once the window is full), so the paged
    attention kernel reads context and block as one run of keys."""
    tables: torch.Tensor    # [B, 1] int32: each sequence's slot, its one page
    q_start: torch.Tensor   # [B] int32: i * g
    q_len: torch.Tensor     # [B] int32: g
    context: torch.Tensor   # [B] int32: the context rows each block attends to
    writes: torch.Tensor    # [B * g] long: the flat ring row of each block row

    @classmethod
    def of(cls, slots: torch.Tensor, context: torch.Tensor, g: int, page: int) -> "RingBlock":
        offsets = torch.arange(g, device=slots.device)
        writes = ((slots * page + context)[:, None] + offsets).flatten()
        return cls(slots[:, None].int(), (torch.arange(slots.shape[0], device=slots.device)
                                          * g).int(),
                   torch.full_like(slots, g, dtype=torch.int32), context.int(), writes)


class DFlashLayer(nn.Module):
    """A Qwen3-style layer whose keys and values also come from the context features."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.self_attn.q_norm = RMSNorm(head_dim, eps)
        self.self_attn.k_norm = RMSNorm(head_dim, eps)
        self.mlp = MLP(hidden, inter)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def keys_values(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden] -> K (normed, rotated) and V: [..., kv_heads, head_dim]."""
        a = self.self_attn
        if x.dim() == 2 and hasattr(a, "kv"):   # on the GPU: one GEMM, one norm+rotary kernel
            kv = F.linear(x, a.kv).unflatten(-1, (2 * self.kv_heads, self.head_dim))
            return a.k_norm.fused_rope(kv[:, :self.kv_heads], *cos_sin), kv[:, self.kv_heads:]
        k = a.k_norm(a.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        return Rotary.apply(k, *cos_sin), a.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))

    def forward(self, x, cos_sin, ctx_k, ctx_v, mask):
        """x: [B, g, hidden] the block; ctx_k/v: [B, W, kv_heads, head_dim]; mask: block_mask's."""
        a = self.self_attn
        h = self.input_layernorm(x)
        q = Rotary.apply(a.q_norm(a.q_proj(h).unflatten(-1, (self.heads, self.head_dim))), *cos_sin)
        k, v = self.keys_values(h, cos_sin)
        x = x + a.o_proj(self._attend(q, k, v, ctx_k, ctx_v, mask))
        return x + self.mlp(self.post_attention_layernorm(x))

    def over_ring(self, x, cos_sin, k_ring, v_ring, ring: RingBlock):
        """The same with the Triton kernels (on the GPU), the context read in place from one
        layer's rings [slots + 1, window + gamma, kv_heads, head_dim]: one norm, one q/k/v GEMM,
        one kernel for the norms and rotary of q and k that also writes the block's K/V into the
        rings after each slot's context, attention over context and block (non-causal) by the
        paged kernel with a slot's ring as its one page, the residual add with the second norm,
        and the MLP's gate/up GEMM with one activation kernel."""
        a, (b, g, hidden) = self.self_attn, x.shape
        rows = x.reshape(b * g, hidden)
        cos, sin = (t.reshape(b * g, 1, -1) for t in cos_sin)
        qkv = F.linear(self.input_layernorm.fused(rows), a.qkv).unflatten(
            -1, (self.heads + 2 * self.kv_heads, self.head_dim))
        q = kernels.qk_norm_rope_to_cache(
            qkv[:, :self.heads], qkv[:, self.heads:self.heads + self.kv_heads],
            qkv[:, self.heads + self.kv_heads:], a.q_norm.weight, a.k_norm.weight, a.q_norm.eps,
            a.q_norm.offset, cos, sin, k_ring, v_ring, ring.writes)
        out = kernels.paged_attention(q, k_ring, v_ring, ring.tables, ring.q_start, ring.q_len,
                                      ring.context, g, self.head_dim ** -0.5, causal=False)
        h, rows = self.post_attention_layernorm.fused(a.o_proj(out.flatten(1)), rows)
        return (rows + self.mlp(h, fused=True)).view(b, g, hidden)

    def _attend(self, q, k, v, ctx_k, ctx_v, mask):
        """The block's queries over the context and the block under `mask`:
        [B, g, heads * head_dim]."""
        keys, values = torch.cat((ctx_k, k), 1), torch.cat((ctx_v, v), 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), attn_mask=mask,
                                             scale=self.head_dim ** -0.5, enable_gqa=True)
        return out.transpose(1, 2).flatten(2)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: dict, num_features: int):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        self.layers = nn.ModuleList(
            DFlashLayer(hidden, heads, cfg.get("num_key_value_heads", heads), head_dim,
                        cfg["intermediate_size"], eps) for _ in range(cfg["num_hidden_layers"]))
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.norm = RMSNorm(hidden, eps)
        self.rotary = Rotary(head_dim, _theta(cfg))


def read_dflash_config(drafter_dir: Path, target: CausalLM) -> dict:
    path = drafter_dir / "config.json"
    cfg = read_json(path, "a DFlash drafter directory")
    tc, dflash = target.config, cfg.get("dflash_config") or {}
    for key in ("block_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if key not in cfg:
            raise ProposerError(f"{path}: {key!r} is missing; not a DFlash drafter config")
    if "mask_token_id" not in dflash or "target_layer_ids" not in dflash:
        raise ProposerError(f"{path}: dflash_config needs mask_token_id and target_layer_ids")
    if cfg["hidden_size"] != tc.hidden_size:
        raise ProposerError(f"DFlash drafter hidden_size {cfg['hidden_size']} does not match the "
                            f"target's {tc.hidden_size}")
    if cfg.get("vocab_size", tc.vocab_size) != tc.vocab_size:
        raise ProposerError(f"DFlash drafter vocab_size {cfg['vocab_size']} does not match the "
                            f"target's {tc.vocab_size}")
    if not 0 <= dflash["mask_token_id"] < tc.vocab_size:
        raise ProposerError(f"DFlash mask_token_id {dflash['mask_token_id']} is outside the "
                            f"target's vocabulary ({tc.vocab_size})")
    bad = [i for i in dflash["target_layer_ids"] if not 0 <= i < tc.num_hidden_layers]
    if bad or cfg.get("num_target_layers", tc.num_hidden_layers) != tc.num_hidden_layers:
        raise ProposerError(f"DFlash target_layer_ids {dflash['target_layer_ids']} / "
                            f"num_target_layers {cfg.get('num_target_layers')} do not fit a target "
                            f"of {tc.num_hidden_layers} layers")
    if cfg["block_size"] < 2:
        raise ProposerError(f"DFlash block_size must be >= 2, got {cfg['block_size']}")
    return cfg


class DFlashProposer:
    method = "dflash"
    max_batch = 64
    keeps_row_state = True

    def __init__(self, target: CausalLM, drafter_dir: str | Path, num_slots: int, window: int,
                 graphs: bool = False):
        drafter_dir = Path(drafter_dir)
        cfg = read_dflash_config(drafter_dir, target)
        device, dtype = target.lm_head.weight.device, target.config.dtype
        self.capture_layers = tuple(cfg["dflash_config"]["target_layer_ids"])
        self.mask_token = cfg["dflash_config"]["mask_token_id"]
        self.gamma = cfg["block_size"]
        self.fixed_drafts = self.gamma - 1
        with torch.device("meta"):
            drafter = DFlashDrafter(cfg, len(self.capture_layers))
        state = read_tensors(drafter_dir, device, dtype)
        expected = drafter.state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ProposerError(f"{drafter_dir}: weights do not fit a DFlash drafter "
                                f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        for name, t in state.items():
            if t.shape != expected[name].shape:
                raise ProposerError(f"{drafter_dir}: {name} has shape {tuple(t.shape)}, expected "
                                    f"{tuple(expected[name].shape)} for this target")
        drafter.load_state_dict(state, assign=True)
        drafter.rotary = Rotary(drafter.rotary.rotary_dim, _theta(cfg)).to(device)  # off meta
        self.drafter, self.target = drafter.eval(), target
        if kernels.runs_on(device):   # q/k/v and gate/up in one tensor each (views of it)
            for layer in drafter.layers:
                a = layer.self_attn
                fuse(a, "qkv", [a.q_proj, a.k_proj, a.v_proj])
                a.kv = a.qkv[a.q_proj.weight.shape[0]:]
                fuse(layer.mlp, "gate_up", [layer.mlp.gate_proj, layer.mlp.up_proj])
        layer = drafter.layers[0]
        # Context: per slot and draft layer, the K/V of the committed positions' features
        # (rotated at their absolute positions), the most recent `window` rows in a ring: the
        # slot's row number i at place i % window. A block attends to every context row alike,
        # so the order of the rows is free, and a full window takes a row in place of its
        # oldest. On the GPU a block's own K/V go just after its context (RingBlock): gamma
        # rows more per ring. (And one spare slot takes the writes of padding rows.)
        shape = (len(drafter.layers), num_slots + 1, window + self.gamma, layer.kv_heads,
                 layer.head_dim)
        self.ctx_k = torch.zeros(shape, dtype=dtype, device=device)
        self.ctx_v = torch.zeros(shape, dtype=dtype, device=device)
        self.seen = [0] * num_slots   # rows each slot's sequence has written (its window: the last)
        self.window = window
        self.held = HeldRows()
        self.graphs = DFlashGraphs(self, self.max_batch) if graphs else None   # (graph workers')

    @classmethod
    def from_worker(cls, target, drafter, num_slots, dflash_window=2048, cuda_graphs=False, **_):
        if not drafter:
            raise ProposerError("speculative method 'dflash' needs a drafter directory (--drafter)")
        return cls(target, drafter, num_slots, dflash_window, cuda_graphs)

    def commit(self, rows: list[CommittedRows]) -> None:
        self._catch_up(self.held.add(rows))

    def before_chain(self, slots: list[int], context_lens: list[int]) -> list[int]:
        """Before a chain of rounds drafts on the device (workers.chain): catches the slots up
        on every row they hold; returns the rows each window has taken (`seen`), where the
        chain's rounds go on writing the ring."""
        self._catch_up(self.held.take(slots))
        return [self.seen[s] for s in slots]

    def after_chain(self, slot: int, context_len: int, tokens: int) -> None:
        """After a chain that emitted `tokens`: its rounds wrote a row into the window for each
        (the pending token and the accepted drafts of every round)."""
        self.seen[slot] += tokens

    def window_rows(self, slot: int) -> int:
        """Context rows the slot's window holds."""
        return min(self.seen[slot], self.window)

    @torch.inference_mode()
    def _catch_up(self, rows: list[CommittedRows]) -> None:
        """The draft layers' K/V of the rows' target features, written into each slot's ring
        (of rows more than a window, the last window's): one projection and one write for all
        (a CUDA graph per row bucket on the GPU)."""
        if not rows:
            return
        features = gather_rows(rows, lambda r: r.step_captured)
        positions, slots, places, kept, first = [], [], [], [], 0
        for r in rows:
            have, n = 0 if r.fresh else self.seen[r.slot], len(r.tokens)
            skip = max(0, n - self.window)   # rows the window's later rows would write over
            positions.extend(range(r.start + skip, r.start + n))
            slots.extend([r.slot] * (n - skip))
            places.extend((have + j) % self.window for j in range(skip, n))
            kept.extend(range(first + skip, first + n))
            self.seen[r.slot] = have + n
            first += n
        if len(kept) < first:
            features = features[to_device(kept, features.device)]
        if self.graphs is None or not self.graphs.write(features, positions, slots, places):
            self._write(features, *to_device([positions, slots, places], features.device))

    def _keys_values(self, features: torch.Tensor, positions: torch.Tensor):
        """K and V [layers, n, kv_heads, head_dim] of rows of target features [n, F]."""
        d = self.drafter
        feats = d.hidden_norm(d.fc(features))
        cos_sin = d.rotary.cos_sin(positions, feats.dtype)
        kv = [layer.keys_values(feats, cos_sin) for layer in d.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def _write(self, features, positions, slots, places) -> None:
        """Each row's K/V into its slot's window at its place (device index tensors)."""
        keys, values = self._keys_values(features, positions)
        self.ctx_k[:, slots, places] = keys
        self.ctx_v[:, slots, places] = values

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        if any(r.allowed for r in requests):   # grammars pick each draft under their mask
            width, rows = self._inputs(requests)
            logits = self._block_logits(*to_device(rows, self.ctx_k.device), width)
            return [self._constrained(req, logits[i]) for i, req in enumerate(requests)]
        tokens, logp = self._best(requests)
        tokens, logp = tokens.tolist(), logp.tolist()   # the one host sync of a proposal
        return [Proposal(tokens[i][:r.num_drafts], logp[i][:r.num_drafts])
                for i, r in enumerate(requests)]

    @torch.inference_mode()
    def propose_on_device(self, requests: list[ProposeRequest]) -> torch.Tensor:
        """Greedy drafts [n, gamma - 1], left on the device."""
        return self._best(requests)[0]

    def _inputs(self, requests: list[ProposeRequest]) -> tuple[int, list[list[int]]]:
        """After the catch-up: the widest context, and the requests' slots, pending tokens,
        their positions and context lengths."""
        self._catch_up(self.held.take(r.slot for r in requests))
        lens = [self.window_rows(r.slot) for r in requests]
        return max(lens), [[r.slot for r in requests], [r.pending for r in requests],
                           [r.position for r in requests], lens]

    def _best(self, requests: list[ProposeRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block position's best token and its log-probability, by the captured block
        forward when one fits."""
        width, rows = self._inputs(requests)
        if self.graphs is not None and len(requests) <= self.graphs.buckets[-1]:
            return self.graphs.run(rows)
        return self._greedy(*to_device(rows, self.ctx_k.device), width)

    def _block_logits(self, slots, pending, positions, lens, width: int) -> torch.Tensor:
        """Logits [B, g-1, vocab] of the block after each pending token, over `width` context
        rows of each slot (rows past its length are masked)."""
        d, g, n = self.drafter, self.gamma, slots.shape[0]
        block = torch.full((n, g), self.mask_token, dtype=torch.long, device=slots.device)
        block[:, 0] = pending
        x = self.target.model.embed_tokens(block)
        cos_sin = tuple(t.unflatten(0, (n, g)) for t in d.rotary.cos_sin(
            (positions[:, None] + torch.arange(g, device=slots.device)[None, :]).flatten(),
            x.dtype))
        if hasattr(d.layers[0].self_attn, "qkv"):   # on the GPU: the rings read in place
            ring = RingBlock.of(slots, lens.clamp(max=self.window), g, self.ctx_k.shape[2])
            for li, layer in enumerate(d.layers):
                x = layer.over_ring(x, cos_sin, self.ctx_k[li], self.ctx_v[li], ring)
        else:
            mask = block_mask(torch.arange(width, device=slots.device)[None, :] < lens[:, None],
                              g)
            for li, layer in enumerate(d.layers):
                x = layer(x, cos_sin, self.ctx_k[li, slots, :width],
                          self.ctx_v[li, slots, :width], mask)
        return self.target.lm_head(d.norm(x[:, 1:])).float()

    def _greedy(self, slots, pending, positions, lens, width: int):
        """Each block position's best token and its log-probability, on the device."""
        logp = torch.log_softmax(self._block_logits(slots, pending, positions, lens, width), -1)
        best = logp.max(-1)
        return best.indices, best.values

    def _constrained(self, req: ProposeRequest, logits: torch.Tensor) -> Proposal:
        prop = Proposal([])
        for j in range(min(req.num_drafts, self.gamma - 1)):
            token, conf = masked_argmax(logits[j], req.allowed(prop.tokens))
            prop.tokens.append(token)
            prop.confidence.append(conf)
        return prop


CATCH_UP_BUCKETS = (8, 16, 32, 64, 128, 256, 512)   # rows of a captured catch-up


class DFlashGraphs:
    """CUDA graphs of a DFlash proposal (the block forward and its argmax) per batch bucket, over
    the whole context window, so one replay drafts for every sequence; and of the catch-up
    (projection of committed rows' features, K/V into the windows) per row bucket, its padding
    rows writing into the spare slot."""

    def __init__(self, proposer: DFlashProposer, max_batch: int):
        self.proposer = proposer
        self.buckets = buckets_up_to(max_batch)
        device, dtype = proposer.ctx_k.device, proposer.ctx_k.dtype
        self.inputs = torch.zeros(4, self.buckets[-1], dtype=torch.long, device=device)
        rows = CATCH_UP_BUCKETS[-1]
        self.features = torch.zeros(rows, proposer.drafter.fc.in_features, dtype=dtype,
                                    device=device)
        self.places = torch.zeros(3, rows, dtype=torch.long, device=device)  # position, slot, place
        self.spare_slot = proposer.ctx_k.shape[1] - 1
        self.graphs: dict[int, tuple] = {}
        self.catch_ups: dict[int, object] = {}
        self.pool = None

    def capture_all(self, max_drafts: int) -> None:
        """Every bucket's graph (a block's drafts do not depend on max_drafts) and every
        catch-up bucket's."""
        self.inputs.zero_()
        self.inputs[0].fill_(self.spare_slot)   # the captures' blocks write the spare ring
        for bucket in reversed(self.buckets):
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)
        self.places[1].fill_(self.spare_slot)
        for rows in reversed(CATCH_UP_BUCKETS):
            if rows not in self.catch_ups:
                self.catch_ups[rows] = self._capture_catch_up(rows)

    def run(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts and log-probabilities [n, gamma - 1] after each pending token; `rows`: the n
        requests' slots, pending tokens, positions and context lengths, sent in one copy."""
        n = len(rows[0])
        bucket = bucket_for(self.buckets, n)
        pad = bucket - n   # padding rows draft from the spare slot's ring, unused
        to_device([rows[0] + [self.spare_slot] * pad] + [row + [0] * pad for row in rows[1:]],
                  self.inputs.device, out=self.inputs[:, :bucket])
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, tokens, logp = self.graphs[bucket]
        graph.replay()
        return tokens[:n], logp[:n]

    def write(self, features: torch.Tensor, positions: list[int], slots: list[int],
              places: list[int]) -> bool:
        """The catch-up of `features` [n, F] into (slot, place) by replay; False when n is
        above the largest bucket (the caller then runs it eagerly)."""
        n = features.shape[0]
        rows = bucket_for(CATCH_UP_BUCKETS, n)
        if rows is None:
            return False
        pad = rows - n
        self.places[:, :rows].copy_(to_device([positions + [0] * pad,
                                               slots + [self.spare_slot] * pad,
                                               places + [0] * pad], features.device))
        self.features[:n].copy_(features)
        if rows not in self.catch_ups:
            self.catch_ups[rows] = self._capture_catch_up(rows)
        self.catch_ups[rows].replay()
        return True

    def round_drafts(self, slots, pending, context, seen, tables, k: int) -> torch.Tensor:
        """A chained round's greedy drafts [n, k] (workers.chain): the block after each pending
        token (at position context) over its slot's window of `seen` rows; past the block's
        gamma - 1, its last draft again."""
        p = self.proposer
        drafts = p._greedy(slots, pending, context, seen, p.window)[0]   # seen: clamped there
        if k > drafts.shape[1]:
            drafts = torch.cat([drafts, drafts[:, -1:].expand(-1, k - drafts.shape[1])], 1)
        return drafts[:, :k]

    def round_commit(self, best, context, count, seen, slots, tables, hidden, captured,
                     length: int) -> None:
        """A chained round's catch-up: the K/V of each sequence's first count[i] rows, from
        their captured target features, into its ring (the other rows into the spare slot);
        each `seen` grows by its count."""
        p = self.proposer
        offset = torch.arange(length, device=context.device)
        positions = context[:, None] + offset
        places = (seen[:, None] + offset) % p.window
        into = torch.where(offset[None, :] < count[:, None], slots[:, None], self.spare_slot)
        p._write(torch.cat(captured, -1), positions.flatten(), into.flatten(), places.flatten())
        seen.add_(count)

    def _capture(self, bucket: int):
        p = self.proposer
        args = [row[:bucket] for row in self.inputs]
        graph, (tokens, logp) = capture(lambda: p._greedy(*args, p.window), self.pool)
        self.pool = graph.pool()
        return graph, tokens, logp

    def _capture_catch_up(self, rows: int):
        p, (positions, slots, places) = self.proposer, self.places[:, :rows]
        graph, _ = capture(lambda: p._write(self.features[:rows], positions, slots, places),
                           self.pool)
        self.pool = graph.pool()
        return graph


def _theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
