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


class Stopped(Exception):
    """A stop signal came while members were being scored."""


@torch.no_grad()
def member_logprobs(model, tokens, max_tokens: int, stop=lambda: False, batch_size: int = 2) -> torch.Tensor:
    """The log-probability of each target token over the val windows that max_tokens allows (the
    trainer's way of choosing eval windows; all of them when max_tokens covers the split), 1-D, fp32
    on the CPU. `stop()` is asked before each batch: True raises Stopped."""
    device, out = model.wte.weight.device, []
    for x, y in val_batches(tokens, model.config.max_seq_len, batch_size, max_tokens):
        if stop():
            raise Stopped("a stop signal came while the ensembles were scored")
        logp = model(x.to(device)).float().log_softmax(-1)
        out.append(logp.gather(-1, y.to(device)[..., None])[..., 0].flatten().cpu())
    return torch.cat(out)


def ensemble_loss(logprobs: list[torch.Tensor]) -> float:
    """Mean negative log of the members' mean probability of each target token (nats/token)."""
    mixed = torch.logsumexp(torch.stack(logprobs), dim=0) - math.log(len(logprobs))
    return -mixed.double().mean().item()


def compare(members: list[tuple], tokens, ks: list[int], max_tokens: int) -> dict:
    """members: (model, meta, path) as checkpoint.load_serving gives them, trained on the same data."""
    return compare_logprobs([(str(path), model.num_params(), member_logprobs(model, tokens, max_tokens))
                             for model, _, path in members], ks)


def compare_logprobs(scored: list[tuple[str, int, torch.Tensor]], ks: list[int]) -> dict:
    """scored: (path, params, member_logprobs) of each member, on the same windows. Returns {"tokens",
    "members": [{"path", "loss", "params"}] best first, "ensembles": [{"k", "loss", "gain" (against the
    best member, negative is better), "params", "members"}]} for each k in ks between 2 and the number
    of members, and all of them."""
    losses = [-lp.double().mean().item() for _, _, lp in scored]
    order = sorted(range(len(scored)), key=lambda i: losses[i])  # best first
    singles = [{"path": scored[i][0], "loss": losses[i], "params": scored[i][1]} for i in order]
    out = {"tokens": len(scored[0][2]), "members": singles, "ensembles": []}
    for k in ensemble_sizes(ks, len(scored)):
        loss = ensemble_loss([scored[i][2] for i in order[:k]])
        out["ensembles"].append({"k": k, "loss": loss, "gain": loss - singles[0]["loss"],
                                 "params": sum(s["params"] for s in singles[:k]),
                                 "members": [s["path"] for s in singles[:k]]})
    return out


def ensemble_sizes(ks, n: int) -> list[int]:
    """The k of ks between 2 and n, and n itself (all the members) when n >= 2."""
    return sorted({k for k in ks if 2 <= k < n} | ({n} if n >= 2 else set()))


def check_same_data(metas: list[tuple[dict, str]]) -> None:
    """metas: (meta, path) of each member. ValueError unless they were prepared from the same data with
    one context: only then do their val losses, and their ensemble's, compare."""
    first, first_path = metas[0]
    for meta, path in metas[1:]:
        if (meta["prepared"]["hash"] != first["prepared"]["hash"]
                or meta["model_config"]["max_seq_len"] != first["model_config"]["max_seq_len"]):
            raise ValueError(f"{path} was prepared from other data or has another context than {first_path}: "
                             "their val losses would not compare")
