"""Depth-parameterized GPT: one knob (depth) sets width, heads and layer count.

Pure module: no I/O, no torch.distributed, no printing. The block follows the modern recipe used by
nanochat / modded-nanogpt: RoPE, parameter-free RMSNorm, QK-norm, ReLU^2 MLP, no biases, untied
embeddings, causal SDPA (flash attention on GPU); for characters, a bigram embedding (a table row
per (previous, current) token pair added to the token's embedding). `generate` is the one-sequence
KV-cache path; the server's batched decoding is experiment/engine.py, which reads this module and is
never read by it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# The bigram table's largest size: exact ((n + 1) * n rows) for up to 127 characters; more ids'
# pairs (a large alphabet, BPE) are hashed into this many. Bounded because every row is a parameter
# with its gradient all-reduced each step: 16384 rows are 25M parameters at d24, 67M at d64.
BIGRAM_ROWS = 1 << 14


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    depth: int = 4
    aspect_ratio: int = 64
    head_dim: int = 128
    max_seq_len: int = 256
    rope_base: float = 10000.0
    # Recipe options (docs/training.md has the ablation that measured each). 0 / False: off.
    # Token ids 0..n-1 the bigram table pairs (0: no table): a row per (previous, current) pair,
    # added to the token embedding; the recipe's one addition its ablation kept (docs/performance.md).
    bigram_vocab: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "depth", "aspect_ratio", "head_dim", "max_seq_len", "bigram_vocab"):
            low = 0 if name == "bigram_vocab" else 1
            if getattr(self, name) < low:
                raise ValueError(f"GPTConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.n_embd % self.head_dim or self.head_dim % 2:
            raise ValueError(
                f"GPTConfig: model_dim = depth * aspect_ratio = {self.n_embd} must be a multiple of "
                f"head_dim = {self.head_dim}, and head_dim must be even (RoPE rotates pairs)"
            )

    @property
    def bigram_rows(self) -> int:
        """One per (previous or none, current) pair, at most BIGRAM_ROWS (then hashed)."""
        return min((self.bigram_vocab + 1) * self.bigram_vocab, BIGRAM_ROWS)

    @property
    def n_layer(self) -> int:
        return self.depth

    @property
    def n_embd(self) -> int:
        return self.depth * self.aspect_ratio

    @property
    def n_head(self) -> int:
        return self.n_embd // self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    # Parameter-free RMSNorm: a learned gain adds nothing the following linear layer cannot absorb.
    return F.rms_norm(x, (x.size(-1),))


class _ReluSquared(torch.autograd.Function):
    """relu(x)^2 with one saved tensor and a one-op backward (2 relu(x) grad, zero where x <= 0).
    Eager autograd of F.relu(x).square() runs pow's and threshold's backward separately: on CPU
    the MLP activation took 15 ms of fwd+bwd at 16 x 256 x 512 against 6 for this."""

    @staticmethod
    def forward(ctx, x):
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return grad * (r + r)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    # Under torch.compile the plain ops fuse into one kernel anyway.
    if torch.compiler.is_compiling():
        return F.relu(x).square()
    return _ReluSquared.apply(x)


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    # On the CPU whatever device is the default (the meta device while build_model builds, where
    # torch would run Python reference kernels: see Embedding); the caller moves them.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device="cpu"), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (T, D/2). Rotates the (first half, second half) pairs.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class KVCache:
    """Preallocated keys/values for every layer; `pos` is the number of positions already filled."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        shape = (config.n_layer, batch_size, config.n_head, config.max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0
        self.last = None  # the last token fed, (B,): the bigram embedding's "previous" after a chunk

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.size(2)
        self.k[layer, :, :, self.pos : self.pos + t] = k
        self.v[layer, :, :, self.pos : self.pos + t] = v
        end = self.pos + t
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """An empty cache writing into existing storage (L, B, H, S, D): one slot of a KVSlots."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.pos, cache.last = k, v, 0, None
        return cache


class Embedding(nn.Embedding):
    """nn.Embedding initializes its table as it is built. On the meta device, where build_model
    builds every model (and the memory planner counts its parameters), that init has no values to
    set and runs torch's Python reference kernel for normal_, whose first call imports
    torch._dynamo: about 3 s of a small CPU in every pre-flight, server and plan. Off the meta
    device it initializes as nn.Embedding does."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.head_dim = config.n_head, config.head_dim
        d = config.n_embd
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, d, bias=False)
        self.c_v = nn.Linear(d, d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.dropout = 0.0  # on the attention weights, in training only (GPT.set_dropout)

    def forward(self, x, cos, sin, cache: KVCache | None):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.c_k(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        # QK-norm bounds attention logits, which keeps high learning rates stable.
        q, k = apply_rope(rms_norm(q), cos, sin), apply_rope(rms_norm(k), cos, sin)
        if cache is None:
            # SDPA's own dropout (CUDA's flash kernel takes it; on CPU SDPA falls back to its math path).
            # 0 in eval, so evals and serving never drop.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            start = cache.pos
            k, v = cache.update(self.layer, k, v)
            if T == 1:  # one new token attends to everything cached so far
                y = F.scaled_dot_product_attention(q, k, v)
            elif start == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # a chunk appended after a prefix: query i sees keys [0, start + i]
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        # ReLU^2 (Primer, So et al. 2021): cheaper than GELU and at least as good at this scale.
        return self.c_proj(relu_squared(self.c_fc(x)))

class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.dropout = 0.0  # on each branch's output before it joins the residual stream (GPT.set_dropout)

    def forward(self, x, cos, sin, cache):
        x = x + self.branch(self.attn(rms_norm(x), cos, sin, cache))
        return x + self.branch(self.mlp(rms_norm(x)))

    def branch(self, y: torch.Tensor) -> torch.Tensor:
        # A Python test, not F.dropout(p=0): off, the traced graph holds no dropout kernel at all.
        return F.dropout(y, self.dropout) if self.dropout and self.training else y

class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.bigram_vocab:
            self.bigram = Embedding(config.bigram_rows, config.n_embd)
        self._set_rope()
        # Recompute each block in backward instead of keeping its activations (set by the trainer
        # when the memory plan needs it): about a third more compute, a fraction of the memory.
        self.activation_checkpointing = False

    def set_dropout(self, residual: float, attention: float) -> None:
        """Training-time dropout (the trainer's DROPOUT and ATTN_DROPOUT; 0: off): `residual` on each
        block's attention and MLP outputs, `attention` on the attention weights. Not part of the
        config: a checkpoint holds the weights, and eval, sampling and serving never drop."""
        for p, name in ((residual, "residual"), (attention, "attention")):
            if not 0 <= p < 1:
                raise ValueError(f"dropout {name} must lie in [0, 1), got {p}")
        for block in self.blocks:
            block.dropout, block.attn.dropout = float(residual), float(attention)

    def _set_rope(self) -> None:
        device = self.wte.weight.device
        cos, sin = rope_tables(self.config.max_seq_len, self.config.head_dim, self.config.rope_base)
        # Non-persistent (derived from the config, so checkpoints hold only learned weights) and
        # always fp32, also when the weights are bf16.
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, draw_on_device: bool = False) -> None:
        """Explicit init (called once by the trainer, never by load): same seed -> same weights, on
        any device and in any dtype. Also (re)computes the RoPE tables, so a model materialized from
        the meta device with to_empty() is complete afterwards. `draw_on_device` draws on the
        weights' device instead (other numbers than the CPU draw): seconds instead of minutes for
        d64, for memory and speed probes whose weights are thrown away."""
        self._set_rope()
        device = self.wte.weight.device if draw_on_device else torch.device("cpu")
        gen = torch.Generator(device=device)
        if seed is not None:
            gen.manual_seed(seed)

        def normal_(p: torch.Tensor, std: float):
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)

        normal_(self.wte.weight, 1.0)
        # A near-zero head starts every prediction near uniform, so the first loss is ~ln(vocab).
        normal_(self.lm_head.weight, 0.001)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                normal_(lin.weight, 1.0 / math.sqrt(lin.in_features))
            # Zero-init residual outputs (modded-nanogpt): each block starts as the identity.
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
        if self.config.bigram_vocab:  # starts as a no-op
            self.bigram.weight.zero_()

    def num_params(self, exclude_embedding: bool = False) -> int:
        """All parameters, or (exclude_embedding) those that are multiplied: not the lookup tables."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.wte.weight.numel() + (self.bigram.weight.numel() if self.config.bigram_vocab else 0)
        return n

    def estimate_flops(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 per matmul weight (fwd + bwd) plus causal-free attention scores.

        The embedding lookup does no matmul, so it is excluded; attention counts QK^T and AV over
        the full context as in PaLM appendix B (12 * layers * model_dim * seq_len).
        """
        t = seq_len or self.config.max_seq_len
        c = self.config
        return 6 * self.num_params(exclude_embedding=True) + 12 * c.n_layer * c.n_embd * t

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        reduction: str = "mean",
        teacher: torch.Tensor | None = None,
        distill: tuple[float, float] = (0.5, 1.0),
    ):
        """idx: (B, T) token ids. With targets: the loss (ignore_index -1); else logits (B, T, V).
        With `teacher`, a teacher's next-token probabilities at temperature distill[1] (B, T, V): the
        loss is distillation_loss's mix of the labels' and the teacher's (reduction "mean" only)."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        if start + T > self.config.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        x = self.embed(idx, self.bigram_ids(idx, cache) if self.config.bigram_vocab else None)
        for block in self.blocks:
            if self.activation_checkpointing and cache is None and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, None, use_reentrant=False)
            else:
                x = block(x, cos, sin, cache)
        if cache is not None:
            cache.pos += T
        logits = self.lm_head(rms_norm(x)).float()  # fp32 logits: a stable softmax under bf16 autocast
        if targets is None:
            return logits
        if teacher is not None:
            return distillation_loss(logits, targets, teacher, *distill)
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=reduction
        )

    def embed(self, idx: torch.Tensor, bigram_ids: torch.Tensor | None) -> torch.Tensor:
        """The first residual stream: token embedding (plus the bigram table's row), normalized."""
        x = self.wte(idx)
        if bigram_ids is not None:
            x = x + self.bigram(bigram_ids)
        return rms_norm(x)

    def bigram_ids(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Row of the bigram table for each position: (previous token, token), the previous of a
        sequence's first position being "none" (bigram_vocab)."""
        n = self.config.bigram_vocab
        first = torch.full_like(idx[:, :1], n)
        if cache is not None and cache.pos > 0:
            first = cache.last[:, None]
        prev = torch.cat([first, idx[:, :-1]], dim=1)
        if cache is not None:
            cache.last = idx[:, -1].clone()
        return bigram_rows(prev, idx, n, self.config.bigram_rows)

    @torch.no_grad()
    def generate(
        self,
        idx: list[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        allowed_vocab: int | None = None,
        top_p: float | None = None,
    ):
        """Yields new token ids one at a time (so callers can stop early, e.g. at a stop string).

        temperature 0 is greedy. With the cache each step costs one token's forward pass; when the
        context fills, the cache is rebuilt from the last half of the context (RoPE positions are
        absolute, so a sliding cache would not be equivalent). `use_cache=False` is the naive path
        (full forward over the last max_seq_len tokens per step); both give the same tokens while the
        total length fits in max_seq_len. `allowed_vocab` masks padded vocabulary ids; top_k and
        top_p restrict sampling (see sample_next).
        """
        if not idx:
            raise ValueError("generate needs at least one prompt token")
        device = self.wte.weight.device
        ctx = self.config.max_seq_len
        tokens = list(idx)
        cache = None
        for _ in range(max_new_tokens):
            if not use_cache:
                window = tokens[-ctx:]
                logits = self(torch.tensor([window], device=device))[:, -1]
            elif cache is None or cache.pos >= ctx:
                keep = context_window(tokens, ctx, rebuild=cache is not None)
                cache = KVCache(self.config, 1, device, self.wte.weight.dtype)
                logits = self(torch.tensor([keep], device=device), cache=cache)[:, -1]
            else:
                logits = self(torch.tensor([[tokens[-1]]], device=device), cache=cache)[:, -1]
            nxt = sample_next(logits, temperature, top_k, generator, allowed_vocab, top_p)
            tokens.append(nxt)
            yield nxt

def distillation_loss(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor, weight: float,
                      temperature: float) -> torch.Tensor:
    """(1 - weight) x the labels' cross-entropy + weight x temperature^2 x KL(teacher || student at the
    temperature), each the mean over the positions with a target (not -1). `teacher` holds the
    teacher's probabilities, already at the temperature. The temperature^2 keeps the distillation
    gradient's scale as the temperature changes (Hinton et al. 2015); KL rather than the soft
    cross-entropy, so the term is 0 when the student matches and the logged loss reads as a loss."""
    flat, y = logits.view(-1, logits.size(-1)), targets.reshape(-1)
    hard = F.cross_entropy(flat, y, ignore_index=-1)
    log_q = F.log_softmax(flat / temperature, dim=-1)
    p = teacher.reshape(-1, teacher.size(-1)).float()
    with torch.no_grad():  # sum p log p needs no gradient: its temporaries go at once (memory.plan_memory)
        plogp = (p * torch.log(p.clamp_min(1e-30))).sum(-1)  # 0 log 0 = 0: the clamp keeps it finite
    kl = plogp - (p * log_q).sum(-1)
    mask = (y != -1).float()
    soft = (kl * mask).sum() / mask.sum().clamp_min(1)
    return (1 - weight) * hard + weight * temperature**2 * soft


def bigram_rows(prev: torch.Tensor, idx: torch.Tensor, n: int, rows: int) -> torch.Tensor:
    """The bigram table's row of (previous, current) for ids below n (previous == n: none): exact
    when rows == (n + 1) * n, hashed when fewer."""
    return (prev * n + idx) % rows


def context_window(tokens: list[int], ctx: int, rebuild: bool) -> list[int]:
    """What a fresh cache is filled with: the prompt's last ctx tokens or, when a full cache is
    rebuilt, the last half of the context (RoPE positions are absolute, so a sliding cache would not
    be equivalent; half leaves ctx/2 one-token steps before the next rebuild)."""
    return tokens[-(ctx // 2) :] if rebuild else tokens[-ctx:]


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    allowed_vocab: int | None = None,
    top_p: float | None = None,
) -> int:
    """One token id from logits (1, V): greedy at temperature 0, else sampled from the softmax at
    `temperature`, restricted to the top_k most likely ids and then to the smallest set of them whose
    probability reaches top_p (nucleus sampling, Holtzman et al. 2019)."""
    return sample_rows(logits[:1], [temperature], [top_k], [top_p], [generator], allowed_vocab)[0]


def sample_rows(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int | None],
    top_p: list[float | None],
    generator: list[torch.Generator | None],
    allowed_vocab: int | None = None,
) -> list[int]:
    """sample_next for each row of logits (B, V), row b with its own settings and generator. A row's
    token does not depend on the others: the shared ops are elementwise or per-row reductions, which
    give a row the same bits alone or in a batch; top_k, top_p and the draw run row by row."""
    logits = logits.float()
    if allowed_vocab is not None:
        logits[:, allowed_vocab:] = -float("inf")
    B = logits.size(0)
    hot = [b for b in range(B) if temperature[b] != 0]
    tokens = logits.argmax(dim=-1).tolist() if len(hot) < B else [0] * B
    if not hot:
        return tokens
    scaled = (logits if len(hot) == B else logits[hot]) / torch.tensor(
        [float(temperature[b]) for b in hot], device=logits.device)[:, None]  # (n, V)
    for i, b in enumerate(hot):
        if top_k[b] is not None:
            row = scaled[i]
            kth = torch.topk(row, min(top_k[b], row.size(-1))).values[-1]
            scaled[i] = row.masked_fill(row < kth, -float("inf"))
    probs = F.softmax(scaled, dim=-1).cpu()  # the draws use CPU generators: one copy, not one per row
    for i, b in enumerate(hot):
        p = probs[i]
        if top_p[b] is not None and top_p[b] < 1:
            sorted_probs, order = p.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs >= top_p[b]  # the mass before it already reaches top_p
            p = p.index_fill(0, order[outside], 0.0)  # multinomial renormalizes
        tokens[b] = int(torch.multinomial(p, 1, generator=generator[b]))
    return tokens


# The trainer's and memory planner's names for the weights' dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(config: GPTConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                state_dict: dict | None = None, seed: int = 0, draw_on_device: bool = False,
                activation_checkpointing: bool = False) -> GPT:
    """The one way a GPT comes into being: on the meta device, then either given `state_dict`'s
    tensors (assign=True: no init, no second copy; cast to `dtype` on `device`) or materialized in
    place and initialized from `seed`. Never a full fp32 copy in host memory first: d64 in fp32 is
    51 GB. Same seed, CPU generator: same weights anywhere (`draw_on_device`: a fast draw on the
    device instead, other numbers, for probes whose weights are thrown away).

    A state_dict with a missing, unexpected or misshaped entry raises RuntimeError (strict load).
    """
    with torch.device("meta"):
        model = GPT(config)
    if state_dict is None:
        model.to(dtype)  # cast while still on meta: materializing fp32 first would cost 2x
        model.to_empty(device=device)
        model.init_weights(seed=seed, draw_on_device=draw_on_device)
    else:
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()},
                              strict=True, assign=True)
        model._set_rope()  # the RoPE tables are derived, not saved: compute them on the weights' device
    model.activation_checkpointing = activation_checkpointing
    return model
