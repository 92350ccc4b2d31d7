"""ZeRO-1: each rank owns a disjoint, size-balanced set of parameters and only their optimizer state.

All ranks hold full (DDP-averaged) gradients; each steps only the parameters it owns, then every
owner broadcasts its updated values in one flattened buffer. Muon (torch.optim.Muon) updates the
hidden matrices; AdamW the embedding, the head and any non-matrix parameter, as in modded-nanogpt
and nanochat. State is saved per rank keyed by parameter name, so any world size can load it.

With master_weights (bf16 parameters on GPU), each rank also keeps an fp32 copy of the parameters
it owns: the optimizer steps the fp32 copy, and the bf16 weights are refreshed from it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

EMBEDDING, UNEMBEDDING, BIGRAM = "wte.weight", "lm_head.weight", "bigram.weight"
# The trainer's CUDA defaults (TrainConfig); probes and tests use them where the values do not matter.
LRS = dict(matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004)


def partition(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """name -> owning rank. Largest first onto the least-loaded rank (ties: lowest rank), so the
    result depends only on the parameter sizes and is identical on every rank."""
    load = [0] * world_size
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += sizes[name]
    return owner


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon's update, state and hyperparameters, with the Newton-Schulz iteration in
    fp32 and batched over matrices of one shape (one bmm chain instead of one per matrix). Used on
    CPU: torch's per-matrix iteration casts to bf16, which these CPUs emulate; for the d4 width-128
    model it took 1.7x the time of fp32 (the README's profile). State is Muon's own
    (momentum_buffer per parameter), so checkpoints move between the two."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mom = group["lr"], group["momentum"]
            by_shape: dict[torch.Size, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                by_shape.setdefault(p.shape, []).append((p, update))
            for shape, items in by_shape.items():
                ortho = newton_schulz(torch.stack([u for _, u in items]).float(), group["ns_coefficients"],
                                      group["ns_steps"], group["eps"])
                scale = torch.optim._muon._adjust_lr(lr, group["adjust_lr_fn"], shape)
                for (p, _), o in zip(items, ortho):
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(o.to(p.dtype), alpha=-scale)


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic iteration on a batch g (N, A, B), in g's dtype."""
    a, b, c = coefficients
    tall = g.size(1) > g.size(2)
    x = g.transpose(1, 2) if tall else g  # (N, short, long): the Gram matrix is the small side
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.transpose(1, 2)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.transpose(1, 2) if tall else x


def is_embedding(name: str) -> bool:
    """The token embedding and the bigram table (model.py): rows are read, not multiplied, so they
    take AdamW at the embedding LR."""
    return name in (EMBEDDING, BIGRAM)


def uses_muon(name: str, shape) -> bool:
    return len(shape) == 2 and not is_embedding(name) and name != UNEMBEDDING


class ShardedOptimizer:
    def __init__(self, model: torch.nn.Module, rank: int = 0, world_size: int = 1, *,
                 matrix_lr: float, embedding_lr: float, unembedding_lr: float,
                 betas=(0.8, 0.95), muon_momentum: float = 0.95, master_weights: bool = False,
                 communicate: bool = True, weight_decay: float = 0.0, adam_weight_decay: float = 0.0):
        """master_weights: keep fp32 copies of owned parameters (create the optimizer while the
        model is still fp32, then cast the model). communicate=False skips the broadcasts: the fit
        probe runs one rank of a simulated world. weight_decay (Muon's matrices) and
        adam_weight_decay (AdamW's groups) are decoupled, as torch applies them: each update first
        multiplies a parameter by 1 - lr x decay, lr its group's scheduled rate."""
        self.rank, self.world_size = rank, world_size
        self.communicate = communicate and world_size > 1
        self.params = dict(model.named_parameters())
        self.owner = partition({n: p.numel() for n, p in self.params.items()}, world_size)
        owned = [n for n in self.params if self.owner[n] == rank]
        self.master = {n: self.params[n].detach().float().clone() for n in owned} if master_weights else {}
        self.target = {n: self.master.get(n, self.params[n]) for n in owned}  # what the optimizers step
        # AdamW lrs were tuned at width 768 (nanochat); scale by 1/sqrt(width) like its trainer.
        width = self.params[EMBEDDING].shape[1]
        adam_scale = (width / 768) ** -0.5
        matrices = [t for n, t in self.target.items() if uses_muon(n, t.shape)]
        adam_groups = [
            {"params": [t for n, t in self.target.items() if is_embedding(n)], "lr": embedding_lr * adam_scale},
            {"params": [t for n, t in self.target.items() if n == UNEMBEDDING], "lr": unembedding_lr * adam_scale},
            {"params": [t for n, t in self.target.items() if t.ndim != 2], "lr": embedding_lr * adam_scale},
        ]
        adam_groups = [g for g in adam_groups if g["params"]]
        self.optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            muon = BatchedMuon if matrices[0].device.type == "cpu" else torch.optim.Muon
            self.optimizers.append(muon(matrices, lr=matrix_lr, momentum=muon_momentum, weight_decay=weight_decay))
        if adam_groups:
            self.optimizers.append(torch.optim.AdamW(adam_groups, betas=betas, eps=1e-10,
                                                     weight_decay=adam_weight_decay))
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        # Broadcast order: each owner's parameters in model order, flattened into one buffer.
        self.owned_by = [[p for n, p in self.params.items() if self.owner[n] == r] for r in range(world_size)]
        self.average = None  # the weight average of the owned parameters (average.WeightAverage), when on

    def set_lr_multiplier(self, mult: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * mult

    def set_muon_momentum(self, momentum: float) -> None:
        for opt in self.optimizers:
            if isinstance(opt, torch.optim.Muon):
                for group in opt.param_groups:
                    group["momentum"] = momentum

    def matrix_lr(self) -> float:
        for opt in self.optimizers:
            if isinstance(opt, torch.optim.Muon):
                return opt.param_groups[0]["lr"]
        return 0.0

    @torch.no_grad()
    def step(self) -> None:
        for name, master in self.master.items():
            grad = self.params[name].grad
            master.grad = None if grad is None else grad.float()
        for opt in self.optimizers:
            opt.step()
        for name, master in self.master.items():
            self.params[name].copy_(master)  # the bf16 weights follow the fp32 masters
            master.grad = None
        self.broadcast_owned()

    @torch.no_grad()
    def broadcast_owned(self) -> None:
        if not self.communicate:
            return
        for r, params in enumerate(self.owned_by):
            if not params:
                continue
            if r == self.rank:
                flat = _flatten_dense_tensors([p.data for p in params])
            else:  # overwritten by the broadcast: flattening our stale copy would read the whole share for nothing
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            dist.broadcast(flat, src=r)
            if r != self.rank:
                for p, new in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.data.copy_(new)

    # ------------------------------------------------------------ state, keyed by parameter name

    def shard_state(self) -> dict:
        """This rank's optimizer state: {name: {state key: tensor}} for the parameters it owns, with
        the fp32 master value under "master" (in either mode, so a resume is exact in both). The
        tensors are the live ones: copy them before the next step changes them."""
        names = {id(t): n for n, t in self.target.items()}
        state = {n: {} for n in self.target}
        for opt in self.optimizers:
            for t, s in opt.state.items():
                # The live tensors, not copies: the saver copies them into its host buffers, and a
                # copy here (on the GPU) would briefly double optimizer memory at every save.
                state[names[id(t)]] = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in s.items()}
        for n, t in self.target.items():
            state[n]["master"] = t.detach().float()  # the target itself: fp32 already in both modes
            if self.average is not None:
                state[n]["average"] = self.average.values[n]
        return {"rank": self.rank, "world_size": self.world_size,
                "owned": [n for n, r in self.owner.items() if r == self.rank], "state": state}

    @torch.no_grad()
    def load_shards(self, shards) -> int:
        """Takes the state of the parameters this rank owns from any shard files (any world size),
        sets owned parameters (and masters) to their saved fp32 values, and shares them with the
        other ranks (a collective). Returns how many parameters got optimizer state."""
        by_target = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for t in group["params"]:
                    by_target[id(t)] = opt
        loaded, averaged = 0, set()
        for shard in shards:
            for name, s in shard["state"].items():
                if name not in self.params:
                    raise KeyError(f"optimizer shard names unknown parameter {name!r}")
                if self.owner[name] != self.rank:
                    continue
                target = self.target[name]
                if "master" in s:
                    target.copy_(s["master"])
                    self.params[name].copy_(s["master"])
                if "average" in s and self.average is not None:
                    self.average.values[name].copy_(s["average"])
                    averaged.add(name)
                opt_state = {k: v for k, v in s.items() if k not in ("master", "average")}
                if opt_state:
                    by_target[id(target)].state[target] = {
                        k: (v.clone().to(target.device) if torch.is_tensor(v) and v.ndim > 0
                            else (v.clone() if torch.is_tensor(v) else v)) for k, v in opt_state.items()}
                    loaded += 1
        if self.average is not None:  # saved without averaging: the average starts from the weights
            self.average.reset_to_weights([n for n in self.target if n not in averaged])
        self.broadcast_owned()
        return loaded


def lr_multiplier(progress: float, warmup_frac: float, warmdown_frac: float, final_lr_frac: float) -> float:
    """LR multiplier at a fraction `progress` of the budget: linear warmup, constant, linear warmdown."""
    p = min(max(progress, 0.0), 1.0)
    if warmup_frac > 0 and p < warmup_frac:
        return p / warmup_frac
    if warmdown_frac > 0 and p > 1 - warmdown_frac:
        return final_lr_frac + (1 - final_lr_frac) * (1 - p) / warmdown_frac
    return 1.0


def muon_momentum(step: int, warmup_steps: int, start: float = 0.85, end: float = 0.95) -> float:
    """Muon's momentum at a step: from `start` up to `end` over the first warmup_steps (nanochat,
    modded-nanogpt): early gradients change fast, and a long average of them points the wrong way."""
    return end if warmup_steps <= 0 else start + (end - start) * min(step / warmup_steps, 1.0)


def gradients_finite(model: torch.nn.Module) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()).item())  # syncs the device

