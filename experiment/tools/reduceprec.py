"""bench reduce: what reducing bf16 gradients in bf16 (DDP's default) costs against fp32.

    python -m experiment.tools.bench reduce [--depth 4 --aspect_ratio 64 --ranks 8 --seq 256 --batch 4]

With PRECISION=bf16 the weights and so the gradients are bf16, and DDP's all-reduce divides each
rank's gradient by the world size and sums in bf16. This simulates that on one CPU: a bf16 model
(trained a few steps first, so the gradients are not those of an initialization), one micro-batch
per simulated rank, then NCCL's ring arithmetic (each hop adds one rank's pre-divided share and
rounds to bf16) against the fp32 mean of the same bf16 gradients. Prints, over the hidden matrices
(the ones Muon steps) and the rest: the reduction's relative error, the error of merely storing the
fp32 mean in bf16 (where an fp32 reduction's result lands: DDP's buckets are the bf16 gradients), how
far one rank's gradient lies from the mean (the sampling noise the step averages away); for the
matrices, Muon's orthogonalized update from the bf16 reduction and from the bf16-stored mean against
the one from the fp32 mean, and the change torch.optim.Muon's own bf16 Newton-Schulz makes.
"""

from __future__ import annotations

import torch

from experiment.model import GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer, newton_schulz, uses_muon
from experiment.step import forward_backward, optimizer_step

# torch.optim.Muon's defaults: quintic coefficients, 5 steps
NS_COEFFICIENTS, NS_STEPS = (3.4445, -4.7750, 2.0315), 5


def add_arguments(p) -> None:
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--aspect_ratio", type=int, default=64)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--warm_steps", type=int, default=20)


def orthogonalize(g: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return newton_schulz(g.to(dtype)[None], NS_COEFFICIENTS, NS_STEPS, 1e-7)[0].float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main(args) -> int:
    config = GPTConfig(vocab_size=256, depth=args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                       max_seq_len=args.seq)
    model = build_model(config, "cpu", torch.float32, seed=0)
    opt = ShardedOptimizer(model, **LRS, master_weights=True)
    model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.warm_steps):
        x = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
        forward_backward(model, x, x)
        optimizer_step(model, opt)
    grads = []  # one bf16 gradient per simulated rank
    for _ in range(args.ranks):
        x = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
        forward_backward(model, x, x)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=False)
    rows = {"matrices": [], "other": []}
    for n, p in model.named_parameters():
        shares = [g[n] / args.ranks for g in grads]  # DDP's pre-division, in bf16
        ring = shares[0]
        for share in shares[1:]:
            ring = ring + share  # bf16 + bf16, rounded to bf16 at each hop
        mean = torch.stack([g[n].float() for g in grads]).mean(0)
        row = [rel(ring.float(), mean), rel(mean.bfloat16().float(), mean), rel(grads[0][n].float(), mean)]
        if uses_muon(n, p.shape):
            # Muon's update (its Newton-Schulz in fp32 here) from each against the one from the fp32
            # mean; and the mean's own, orthogonalized in bf16 as torch.optim.Muon does on the GPU
            exact = orthogonalize(mean)
            row += [rel(orthogonalize(ring), exact), rel(orthogonalize(mean.bfloat16()), exact),
                    rel(orthogonalize(mean, torch.bfloat16), exact)]
            rows["matrices"].append(row)
        else:
            rows["other"].append(row)
    print(f"bench reduce | d{args.depth} width {config.n_embd}, bf16 weights, {args.ranks} simulated ranks x "
          f"{args.batch} x {args.seq} tokens, after {args.warm_steps} steps | relative errors, median over parameters")
    names = ["bf16 ring all-reduce", "fp32 mean stored in bf16", "one rank's gradient (sampling noise)",
             "Muon update from the bf16 reduction", "from the fp32 mean stored in bf16",
             "Muon's own bf16 Newton-Schulz"]
    for kind, table in rows.items():
        if not table:
            continue
        medians = torch.tensor(table).median(0).values.tolist()
        print(f"{kind} ({len(table)}):\n  " + "\n  ".join(f"{name}: {100 * v:.3f}%" for name, v in zip(names, medians)))
    return 0
