"""Compare two sweeps' members at their final step, tensor by tensor: the model, every optimizer
shard (which holds the weight average where there is one) and the served best.pt."""
import sys
from pathlib import Path

import torch

from experiment import checkpoint as ckpt


def tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}/{i}")


def same(a: Path, b: Path) -> tuple[int, int]:
    ta, tb = dict(tensors(ckpt.load_tensors(a))), dict(tensors(ckpt.load_tensors(b)))
    assert ta.keys() == tb.keys(), (a, set(ta) ^ set(tb))
    return sum(torch.equal(ta[k], tb[k]) for k in ta), len(ta)


got, want = Path(sys.argv[1]), Path(sys.argv[2])
ok = True
for member in sorted(p.name for p in want.iterdir() if p.is_dir()):
    g, w = got / member, want / member
    step = max(ckpt.complete_steps(w))
    assert max(ckpt.complete_steps(g)) == step, (member, ckpt.complete_steps(g), step)
    files = [ckpt.model_path(w, step).name, ckpt.optim_path(w, step, 0).name, "best.pt"]
    for name in files:
        n, total = same(g / name, w / name)
        ok &= n == total
        print(f"{member} step {step} {name}: {n}/{total} tensors bit-equal")
    bg, bw = ckpt.read_best(g), ckpt.read_best(w)
    print(f"{member} best.json: killed {bg['step']} {bg['val_loss']:.6f} | uninterrupted {bw['step']} {bw['val_loss']:.6f}")
    ok &= (bg["step"], bg["val_loss"]) == (bw["step"], bw["val_loss"])
print("ALL EQUAL" if ok else "DIFFER")
