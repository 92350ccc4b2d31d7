"""`bench ensemble`: the full-val loss of each checkpoint and of the ensembles of the best k, the
model `serve --checkpoint A,B,...` decodes (the mean of the members' next-token probabilities).

    python -m experiment.tools.bench ensemble --checkpoints RUN_A RUN_B RUN_C [--k 2 4] [--device cpu]
                                              [--prepared_dir DIR]

Each checkpoint is what the server would load for it (a run directory: its best). The members are
ranked by their own loss; the ensemble of the best k for each k asked (default: 2, 4 and all that
many there are). Every loss is over every whole window of the first member's val split (the members
must share a tokenizer, a context and a val split: runs prepared from the same data, the same hash;
--prepared_dir: where that data lies on this machine, if not where the first member was trained),
in nats per token, in the precision each checkpoint loads in. Prints one line per model and per
ensemble; a checkpoint or data it cannot use exits 2 with one line naming it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment.batches import val_batches
from experiment.dataloader import Prepared
from experiment.distributed import resolve_device
from experiment.files import default_workspace


@torch.no_grad()
def token_logprobs(models: list, tokens, seq_len: int, batch_size: int = 2) -> list[torch.Tensor]:
    """Per model, the log-probability of each target token over every whole val window (1-D, fp32)."""
    out = [[] for _ in models]
    for x, y in val_batches(tokens, seq_len, batch_size, len(tokens)):
        for i, model in enumerate(models):
            x_, y_ = x.to(model.wte.weight.device), y.to(model.wte.weight.device)
            logp = model(x_).log_softmax(-1)
            out[i].append(logp.gather(-1, y_[..., None])[..., 0].flatten().cpu())
    return [torch.cat(parts) for parts in out]


def ensemble_loss(logprobs: list[torch.Tensor]) -> float:
    """Mean negative log of the members' mean probability of each target token (nats/token)."""
    mixed = torch.logsumexp(torch.stack(logprobs), dim=0) - math.log(len(logprobs))
    return -mixed.double().mean().item()


def add_arguments(p) -> None:
    p.add_argument("--checkpoints", nargs="+", required=True, help="run directories, model files or exports")
    p.add_argument("--k", type=int, nargs="*", default=[2, 4], help="ensemble sizes besides all of them")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--workspace", default=None)
    p.add_argument("--prepared_dir", default=None, help="the members' prepared data (default: the first one's)")


def load(args) -> tuple[list, Prepared]:
    """The members and their val data; ValueError naming what cannot be used."""
    workspace = Path(args.workspace) if args.workspace else default_workspace()
    members = ckpt.load_serving(",".join(map(str, args.checkpoints)), workspace, resolve_device(args.device))
    (first_model, first, first_path) = members[0]
    for model, meta, path in members[1:]:
        if meta["prepared"]["hash"] != first["prepared"]["hash"] or model.config.max_seq_len != first_model.config.max_seq_len:
            raise ValueError(f"{path} was prepared from other data or has another context than {first_path}: "
                             "their val losses would not compare")
    directory = Path(args.prepared_dir or first["prepared"]["dir"])
    try:
        prepared = Prepared.load(directory)
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory}: the members' prepared data is not there ({e}); give --prepared_dir") from None
    if prepared.meta["hash"] != first["prepared"]["hash"]:
        raise ValueError(f"{directory} holds other data than the members were trained on")
    return members, prepared


def main(args) -> int:
    try:
        members, prepared = load(args)
    except (ValueError, ckpt.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens, seq = prepared.tokens("val"), members[0][0].config.max_seq_len
    logprobs = token_logprobs([m for m, _, _ in members], tokens, seq)
    singles = sorted(((-lp.double().mean().item(), i) for i, lp in enumerate(logprobs)))
    print(f"ensemble | {len(logprobs[0]):,} val tokens, every whole {seq}-token window of {prepared.dir}")
    for loss, i in singles:
        print(f"ensemble | member {members[i][2]}: {loss:.4f}")
    best = singles[0][0]
    for k in sorted({k for k in args.k if 2 <= k < len(members)} | {len(members)}):
        if k < 2:
            continue
        loss = ensemble_loss([logprobs[i] for _, i in singles[:k]])
        print(f"ensemble | best {k}: {loss:.4f} ({loss - best:+.4f} against the best member)")
    return 0
