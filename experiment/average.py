"""The weight average (AVERAGE=ema): a power-function EMA of the weights (Karras et al. 2024,
"Analyzing and improving the training dynamics of diffusion models"), kept beside the optimizer.

An ordinary EMA's horizon is a number of steps, which would have to be chosen for a run whose
length the stop at the val minimum decides. The power-function EMA averages a fixed fraction of
the run so far instead: at update t its decay is (1 - 1/t)^(gamma + 1), and its width relative to t
is AVERAGE_WIDTH (0.1: about the last tenth of the steps). It needs no warm start and no bias fix:
update 1 copies the weights.

Each rank averages only the parameters it owns (ZeRO-1, optim.py), in fp32 from the same values the
optimizer steps: 4 bytes per owned parameter, counted in the memory plan. The averages travel in the
optimizer shards (key "average"), so a resume on any world size continues them exactly."""

from __future__ import annotations

import contextlib

import torch

from experiment.optim import ShardedOptimizer

KINDS = ("none", "ema")
MAX_WIDTH = 0.2886  # just under the width at gamma = 0, 1 / (2 sqrt 3) = 0.28868: none is wider


def width_of(gamma: float) -> float:
    """The average's standard deviation relative to the step it is taken at (Karras et al., eq. 3)."""
    return (gamma + 1) ** 0.5 / ((gamma + 2) * (gamma + 3) ** 0.5)


def gamma_for(width: float) -> float:
    """The exponent whose width is `width` (0 < width <= MAX_WIDTH); width_of falls as gamma grows."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if width_of(mid) > width else (lo, mid)
    return (lo + hi) / 2


class WeightAverage:
    def __init__(self, opt: ShardedOptimizer, width: float, device: torch.device | None = None, every: int = 1):
        """device: where the average lives (default: beside the weights); every: fold the weights in
        at every this many steps only (the host copy of a model too large for its GPU)."""
        self.opt, self.every = opt, every
        self.gamma = gamma_for(width)
        self.names = list(opt.target)  # the parameters this rank owns
        self.values = {n: t.detach().float().to(device or t.device, copy=True) for n, t in opt.target.items()}

    def decay(self, t: int) -> float:
        """The weight the average keeps when step t (1-based) folds in the weights, `every` steps after
        the last fold: the product of the per-step decays (1 - 1/s)^(gamma + 1) over those steps, as if
        the weights had stood still between folds. 0 at the first fold, which copies."""
        return (1 - self.every / t) ** (self.gamma + 1)

    @torch.no_grad()
    def update(self, t: int) -> None:
        """Fold in the weights after step t (the run's step count, so a resume continues exactly)."""
        if not self.names or t % self.every:
            return
        averages = [self.values[n] for n in self.names]
        weights = [self.opt.target[n].float().to(averages[0].device) for n in self.names]
        torch._foreach_lerp_(averages, weights, 1 - self.decay(t))

    @torch.no_grad()
    def reset_to_weights(self, names) -> None:
        """Start these parameters' averages from their weights (a checkpoint written without them)."""
        for n in names:
            self.values[n].copy_(self.opt.target[n])

    @contextlib.contextmanager
    def swapped_in(self):
        """Every rank's model holds the average (each owner broadcasts its part), then its own weights
        again: the eval measures the average. A collective on entry and on exit."""
        params = self.opt.params
        with torch.no_grad():  # without fp32 masters, the weights wait in host memory: no GPU memory for them
            kept = {n: params[n].detach().to("cpu", copy=True) for n in self.names if n not in self.opt.master}
            for n in self.names:
                params[n].copy_(self.values[n])
            self.opt.broadcast_owned()
        try:
            yield
        finally:
            with torch.no_grad():
                for n in self.names:  # the fp32 master, else the copy kept above: the weights bit for bit
                    params[n].copy_(self.opt.master.get(n, kept.get(n)))
                self.opt.broadcast_owned()

    def model_part(self, state: dict) -> dict:
        """A model state_dict with the owned parameters' averages in place of their weights, in the
        weights' dtype: what a checkpoint whose served weights are the average writes."""
        return {**state, **{n: self.values[n].to(state[n].dtype) for n in self.names}}
