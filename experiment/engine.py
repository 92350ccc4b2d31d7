"""Batched, batch-invariant decoding for the server: the model's weights, decoded for many requests.

A request's tokens never depend on who else is in the batch. Prefill and context rebuilds run the
model's own forward over one request's tokens (as GPT.generate does); each later token is one
decode step for every running request at once, in which every matmul runs on blocks of a fixed
number of rows (block_linear) and each row attends in products of its own (row_attention), so a
row's sums are the same whatever the batch. The model module knows nothing of this file; the
server (experiment/server.py) schedules a Batch from one engine thread.

An ensemble is several models decoded as one: each runs its own prefill and decode steps on its own
KV cache, and the token is drawn from the mean of their next-token probabilities (mix_logits). Each
member's logits are batch-invariant, and the mean is taken row by row, so the ensemble is too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from experiment.model import (GPT, MLP, Attention, Block, GPTConfig, KVCache, apply_rope, bigram_rows, context_window, rms_norm,
                              sample_rows)


class KVSlots:
    """Keys/values of up to `slots` sequences (the server's batch), each with its own length.

    Allocated once, so the serving batch has a fixed memory cost (bytes_per_slot each). A slot is
    filled by GPT.forward through `slot(i)`, a batch-1 KVCache view, as generate fills its own
    cache; decode_step then appends one token to each of the first n slots, each at its own
    position. Batch keeps its sequences in slots 0..n-1 (move() closes the gap one leaves), so
    decoding reads the cache through views, never a gathered copy.
    """

    def __init__(self, config: GPTConfig, slots: int, device, dtype):
        shape = (config.n_layer, slots, config.n_head, config.max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_slot(config: GPTConfig, dtype: torch.dtype) -> int:
        return 2 * config.n_layer * config.n_head * config.max_seq_len * config.head_dim * dtype.itemsize

    def slot(self, i: int) -> KVCache:
        return KVCache.over(self.k[:, i : i + 1], self.v[:, i : i + 1])

    def move(self, src: int, dst: int, n: int) -> None:
        """Slot src's first n positions (all it holds) into slot dst; dst's later positions are stale,
        as a fresh slot's are: decoding masks every position past a row's own."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]


# A row's attention spans its own position rounded up to a multiple of this many: a few shapes for
# the BLAS to plan, each a whole number of SIMD vectors.
DECODE_SPAN_STEP = 64


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
    """One row's attention: q (H, 1, D) at position pos over its own slot's keys and values (H, T, D),
    those after pos masked out. (H, 1, D).

    Each row is its own pair of bmm calls, whose shapes depend on nothing but its position, so its
    bits cannot depend on the batch. One bmm over every (row, head) of the batch did: the CPU BLAS
    plans a batched product by its batch count, and a row's sums changed with how many rows ran
    beside it (fp32, one head of 128 at 300 positions; bf16 on an AMD EPYC). A row also reads only
    its own span, not the longest row's: a d12 decode step of 1 to 32 rows at positions 100-1,000
    took 0.55-1.01x the time of the one batch-wide bmm on a 2-core Xeon (fp32 and bf16).
    """
    span = min(keys.size(1), -(-(pos + 1) // DECODE_SPAN_STEP) * DECODE_SPAN_STEP)
    keys = keys[:, :span]
    # The faster product for each dtype on that Xeon: in bf16, q @ keys^T made the 32-row step 1.4x
    # the batch-wide bmm's time (keys^T is a strided operand the BLAS copies); in fp32 it is the faster
    scores = (torch.bmm(q, keys.transpose(1, 2)) if q.dtype == torch.float32
              else torch.bmm(keys, q.transpose(1, 2)).transpose(1, 2))  # (H, 1, span)
    # fp32 softmax also under bf16 weights, as SDPA keeps its softmax in fp32
    scores = scores.float() * q.size(-1) ** -0.5
    scores[..., pos + 1 :] = -float("inf")
    return torch.bmm(scores.softmax(dim=-1).to(values.dtype), values[:, :span])


# Decode matmuls run on blocks of exactly this many rows (zero-padded), whatever the batch.
DECODE_ROWS = 8


def block_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x) for x (B, 1, K) in blocks of DECODE_ROWS rows: row b's result does not depend on B.

    Batched decoding must give each request exactly the tokens it would get alone, but a GEMM sums in
    another order for another number of rows M (MKL: M = 1 is a GEMV), so layer(x)[b] would change
    in the last bits with the batch size. One fixed M gives one kernel, and within it a row's sums do
    not depend on the other rows or on its place (the tests check it, fp32 and bf16). Multiplying
    each row alone would also be exact, but reads the weights once per row: measured on one core, a
    2048 x 8192 layer at 32 rows took 109 ms row by row, 4 x 11 ms in blocks of 8 (3.5 ms for 1 row
    alone, so a lone request pays about 3x in its matmuls; on a GPU, memory-bound, less).
    """
    B = x.size(0)
    rows = x.reshape(B, -1)
    if B % DECODE_ROWS:
        rows = torch.cat([rows, rows.new_zeros(DECODE_ROWS - B % DECODE_ROWS, rows.size(1))])
    out = torch.cat([F.linear(block, layer.weight) for block in rows.split(DECODE_ROWS)])
    return out[:B].view(B, 1, -1)  # (B, 1, N)


def decode_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVSlots,
                     pos: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """One new token for each of the cache's first B slots: x (B, 1, C), row b at position
    positions[b] (pos: the same on the device); cos/sin (B, 1, 1, D/2)."""
    B, _, C = x.shape
    H, D = attn.n_head, attn.head_dim
    q = block_linear(x, attn.c_q).view(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D)
    k = block_linear(x, attn.c_k).view(B, 1, H, D).transpose(1, 2)
    v = block_linear(x, attn.c_v).view(B, 1, H, D).transpose(1, 2)
    q, k = apply_rope(rms_norm(q), cos, sin), apply_rope(rms_norm(k), cos, sin)
    q = q.contiguous()  # each row's (H, 1, D) laid out alike whatever B
    rows = torch.arange(B, device=x.device)
    cache.k[attn.layer, rows, :, pos] = k[:, :, 0]  # (B, H, D): each row's slot at its own position
    cache.v[attn.layer, rows, :, pos] = v[:, :, 0]
    # Row by row (see row_attention); SDPA is not batch-invariant either: its kernel splits the keys
    # into blocks by length and rescales the partial sums.
    y = torch.stack([row_attention(q[b], cache.k[attn.layer, b], cache.v[attn.layer, b], p)
                     for b, p in enumerate(positions)])  # (B, H, 1, D)
    return block_linear(y.transpose(1, 2).reshape(B, 1, C), attn.c_proj)


def decode_mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """MLP.forward in fixed blocks of rows (see block_linear)."""
    return block_linear(F.relu(block_linear(x, mlp.c_fc)).square(), mlp.c_proj)


def decode_block(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVSlots,
                 pos: torch.Tensor, positions: list[int]) -> torch.Tensor:
    x = x + decode_attention(block.attn, rms_norm(x), cos, sin, cache, pos, positions)
    return x + decode_mlp(block.mlp, rms_norm(x))


@torch.no_grad()
def decode_step(model: GPT, tokens: list[int], positions: list[int], cache: KVSlots,
                previous: list[int] | None = None) -> torch.Tensor:
    """Logits (B, V) of one new token for each of the cache's first B slots: tokens[b] at position
    positions[b] of slot b, whose earlier positions are in the cache (the last of them is
    previous[b], which the bigram embedding reads; bigram_vocab, "none", at position 0). Batch-invariant: row b's
    logits are bit-identical whatever the other rows hold and however many there are (they
    agree with forward's to float rounding, not bit for bit).
    """
    if max(positions) >= model.config.max_seq_len:
        raise ValueError(f"position {max(positions)} is past max_seq_len {model.config.max_seq_len}")
    device = model.wte.weight.device
    pos = torch.tensor(positions, device=device)
    cos, sin = model.rope_cos[pos][:, None, None], model.rope_sin[pos][:, None, None]  # (B, 1, 1, D/2)
    idx = torch.tensor(tokens, device=device)[:, None]  # (B, 1)
    bigram = None
    if model.config.bigram_vocab:
        prev = torch.tensor(previous, device=device)[:, None]
        bigram = bigram_rows(prev, idx, model.config.bigram_vocab, model.config.bigram_rows)
    x = model.embed(idx, bigram)  # (B, 1, C)
    for block in model.blocks:
        x = decode_block(block, x, cos, sin, cache, pos, positions)
    return block_linear(rms_norm(x), model.lm_head).float()[:, 0]  # fp32 logits, as forward


def check_ensemble(models: list[GPT]) -> None:
    """ValueError unless the models can be decoded as one: the same vocabulary and context (the
    tokenizer itself is the caller's to compare: it lives in the checkpoints' meta)."""
    first = models[0].config
    for i, m in enumerate(models[1:], 1):
        for name in ("vocab_size", "max_seq_len"):
            if getattr(m.config, name) != getattr(first, name):
                raise ValueError(f"ensemble member {i + 1} has {name} {getattr(m.config, name)}, member 1 has "
                                 f"{getattr(first, name)}: an ensemble's members need the same")


def mix_logits(logits: list[torch.Tensor], allowed_vocab: int | None = None) -> torch.Tensor:
    """Log of the mean of the members' next-token probabilities (B, V), usable as logits: sampling
    with temperature T from them draws from that mean raised to 1/T. One member: its own logits,
    untouched, so a single model decodes exactly as before. Tokens at or past allowed_vocab (the
    tokenizer's padding) are out before each member's softmax."""
    if len(logits) == 1:
        return logits[0]
    logp = torch.stack([x.float() for x in logits])  # (members, B, V)
    if allowed_vocab is not None:
        logp[..., allowed_vocab:] = -float("inf")
    return torch.logsumexp(logp.log_softmax(dim=-1), dim=0) - math.log(len(logits))


@dataclass
class _Member:
    id: int
    tokens: list[int]  # prompt and generated so far
    pos: int  # how many positions of its slot the cache holds
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None


class Batch:
    """Generations sharing decode steps: the server's batched counterpart of GPT.generate.

    join() prefills a prompt into the next free slot and returns (member id, first token); step()
    returns every member's next token by id; leave() frees a member's slot. A member's tokens are
    exactly those it gets in a Batch of its own, whoever else is in the batch and whenever it joined:
    the same prefill and context rebuild as generate (forward over its own tokens, alone), then
    batch-invariant decode steps (decode_step) and its own generator for sampling. No threads,
    no I/O: the caller schedules. `model` may be a list of models: an ensemble (mix_logits), each
    with its own KV cache.
    """

    def __init__(self, model: GPT | list[GPT], slots: int, allowed_vocab: int | None = None):
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        check_ensemble(self.models)
        self.model, self.slots, self.allowed_vocab = self.models[0], slots, allowed_vocab  # allowed_vocab: see generate
        self.caches = [KVSlots(m.config, slots, m.wte.weight.device, m.wte.weight.dtype) for m in self.models]
        self.rows: list[_Member] = []  # rows[i] lives in slot i
        self._next_id = 0

    @property
    def free(self) -> int:
        return self.slots - len(self.rows)

    @torch.no_grad()
    def join(self, idx: list[int], temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, top_p: float | None = None) -> tuple[int, int]:
        if not idx:
            raise ValueError("a generation needs at least one prompt token")
        if not self.free:
            raise RuntimeError("every slot of the batch is taken")
        member = _Member(self._next_id, list(idx), 0, temperature, top_k, top_p, generator)
        self._next_id += 1
        self.rows.append(member)
        ctx = self.model.config.max_seq_len
        return member.id, self._prefill(len(self.rows) - 1, context_window(member.tokens, ctx, rebuild=False))

    def leave(self, member_id: int) -> None:
        row = next(i for i, m in enumerate(self.rows) if m.id == member_id)
        last = len(self.rows) - 1
        if row != last:  # the last member moves into the gap: slots 0..n-1 stay the members'
            for cache in self.caches:
                cache.move(last, row, self.rows[last].pos)
            self.rows[row] = self.rows[last]
        self.rows.pop()

    def clear(self) -> None:
        """Drops every member at once; no cache is moved (a later join prefills its slot afresh)."""
        self.rows.clear()

    @torch.no_grad()
    def step(self) -> dict[int, int]:
        """The next token of every member, by id."""
        if not self.rows:
            return {}
        ctx = self.model.config.max_seq_len
        out = {}
        for row, m in enumerate(self.rows):
            if m.pos >= ctx:  # its cache is full: rebuilt alone, as generate does
                out[m.id] = self._prefill(row, context_window(m.tokens, ctx, rebuild=True))
        if len(out) == len(self.rows):  # every member was rebuilt: no decode left to do
            return out
        tokens, positions = [m.tokens[-1] for m in self.rows], [m.pos for m in self.rows]
        logits = mix_logits([decode_step(model, tokens, positions, cache,  # bigram_vocab: "no previous token"
                                         [m.tokens[-2] if m.pos else model.config.bigram_vocab for m in self.rows])
                             for model, cache in zip(self.models, self.caches)], self.allowed_vocab)
        # A member rebuilt above has its token; its decode just done (at the position its next step
        # writes again) is discarded.
        rows = [row for row, m in enumerate(self.rows) if m.id not in out]
        members = [self.rows[row] for row in rows]
        for m in members:
            m.pos += 1
        if members:
            tokens = self._sample(members, logits if len(rows) == len(self.rows) else logits[rows])
            out.update((m.id, t) for m, t in zip(members, tokens))
        return out

    def _prefill(self, row: int, keep: list[int]) -> int:
        slots = [cache.slot(row) for cache in self.caches]
        logits = mix_logits([model(torch.tensor([keep], device=model.wte.weight.device), cache=slot)[:, -1]
                             for model, slot in zip(self.models, slots)], self.allowed_vocab)
        self.rows[row].pos = slots[0].pos
        return self._sample([self.rows[row]], logits)[0]

    def _sample(self, members: list[_Member], logits: torch.Tensor) -> list[int]:
        tokens = sample_rows(logits, [m.temperature for m in members], [m.top_k for m in members],
                             [m.top_p for m in members], [m.generator for m in members], self.allowed_vocab)
        for m, token in zip(members, tokens):
            m.tokens.append(token)
        return tokens


def prompt_ids(tok, prompt: str, ctx: int) -> tuple[list[int], int]:
    """(the token ids a prompt is decoded from, how many were cut from its left to fit the context).
    ValueError names characters the vocabulary lacks."""
    # Training windows start anywhere in the text, so a prompt is context enough; BOS (the start of
    # a document) only stands in for an empty prompt.
    ids = tok.encode(prompt) or [tok.bos_id]
    dropped = max(0, len(ids) - ctx)  # the model sees at most its context; cut from the left
    return ids[dropped:], dropped


@torch.no_grad()
def generate(model: GPT | list[GPT], ids: list[int], max_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, generator: torch.Generator | None = None,
             allowed_vocab: int | None = None):
    """Yields up to max_tokens new token ids for one prompt, decoded as the server decodes a request:
    a Batch of one, whose tokens are those the request gets in any batch (same seed, same tokens).
    The sample command and the trainer's eval samples come here."""
    batch = Batch(model, 1, allowed_vocab)
    member, token = batch.join(ids, temperature, top_k, generator, top_p)
    yield token
    for _ in range(max_tokens - 1):
        yield batch.step()[member]
