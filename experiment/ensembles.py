"""The val loss of an ensemble: the model `serve --checkpoint A,B,...` decodes (the mean of the members'
next-token probabilities), against each member alone, on the same val windows.

`compare` is what a sweep reports when its members end (sweep.md's ensembles) and what `bench
ensemble` prints. Members are ranked by their own loss on those windows; the ensemble of the best k
is scored for each k asked. Every loss is in nats per token, each member in the precision it loads in.
"""

from __future__ import annotations

import math
import torch

from experiment.batches import val_batches


@torch.no_grad()
def token_logprobs(models: list, tokens, seq_len: int, max_tokens: int, batch_size: int = 2) -> list[torch.Tensor]:
    """Per model, the log-probability of each target token over the val windows that max_tokens allows
    (the trainer's fixed eval sample; all of them when max_tokens covers the split), 1-D, fp32."""
    out = [[] for _ in models]
    for x, y in val_batches(tokens, seq_len, batch_size, max_tokens):
        for i, model in enumerate(models):
            x_, y_ = x.to(model.wte.weight.device), y.to(model.wte.weight.device)
            logp = model(x_).float().log_softmax(-1)
            out[i].append(logp.gather(-1, y_[..., None])[..., 0].flatten().cpu())
    return [torch.cat(parts) for parts in out]


def ensemble_loss(logprobs: list[torch.Tensor]) -> float:
    """Mean negative log of the members' mean probability of each target token (nats/token)."""
    mixed = torch.logsumexp(torch.stack(logprobs), dim=0) - math.log(len(logprobs))
    return -mixed.double().mean().item()


def compare(members: list[tuple], tokens, ks: list[int], max_tokens: int) -> dict:
    """members: (model, meta, path) as checkpoint.load_serving gives them, trained on the same data.
    Returns {"tokens", "members": [{"path", "loss", "params"}] best first, "ensembles": [{"k", "loss",
    "gain" (against the best member, negative is better), "params", "members"}]} for each k in ks
    between 2 and the number of members, and all of them."""
    seq = members[0][0].config.max_seq_len
    logprobs = token_logprobs([m for m, _, _ in members], tokens, seq, max_tokens)
    losses = [-lp.double().mean().item() for lp in logprobs]
    order = sorted(range(len(members)), key=lambda i: losses[i])  # best first
    singles = [{"path": str(members[i][2]), "loss": losses[i], "params": members[i][0].num_params()} for i in order]
    out = {"tokens": len(logprobs[0]), "members": singles, "ensembles": []}
    for k in sorted({k for k in ks if 2 <= k < len(members)} | {len(members)}):
        if k < 2:
            continue
        loss = ensemble_loss([logprobs[i] for i in order[:k]])
        out["ensembles"].append({"k": k, "loss": loss, "gain": loss - singles[0]["loss"],
                                 "params": sum(s["params"] for s in singles[:k]),
                                 "members": [s["path"] for s in singles[:k]]})
    return out


def check_same_data(members: list[tuple]) -> None:
    """ValueError unless the members were prepared from the same data with one context: only then do
    their val losses, and their ensemble's, compare."""
    first_model, first, first_path = members[0]
    for model, meta, path in members[1:]:
        if meta["prepared"]["hash"] != first["prepared"]["hash"] or model.config.max_seq_len != first_model.config.max_seq_len:
            raise ValueError(f"{path} was prepared from other data or has another context than {first_path}: "
                             "their val losses would not compare")


