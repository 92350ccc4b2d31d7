"""Sources and their weights: which source each training window comes from.

Each sub-directory of DATA_DIR is a source, and its top-level data files one more. DATA_MIX
("web=0.65,code=0.34,math=0.01") weights them: the global sequence of training windows draws its
source by weight and then that source's next window. Window g's source is a function of (seed, g)
alone, and a source's k-th window is entry k mod n of its own per-epoch permutation, so the sequence
is the same whatever the world size, and the state (the global cursor and the windows each source
has given) is the same on every rank: a resume, also on another world size, continues it exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from experiment.config import ConfigError
from experiment.batches import window_batch, window_layout

CHUNK = 4096  # windows whose sources are drawn at once: the choice of window g depends on (seed, g // CHUNK)
SOURCE_STREAM = 7919  # keeps the source draw's random stream apart from the per-source permutations'


class MixError(ConfigError):
    """A DATA_MIX that cannot work; the message names the source or the entry."""


def parse_mix(text: str, names: list[str]) -> list[float]:
    """DATA_MIX -> one weight per source, in `names`' order, summing to 1. Every source needs a
    weight (0 leaves it out), so a renamed or added file cannot silently change the mixture."""
    weights = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, sep, value = entry.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or weight < 0 or not np.isfinite(weight):
            raise MixError(f"DATA_MIX entry {entry!r}: expected source=weight with a weight >= 0")
        if name not in names:
            raise MixError(f"DATA_MIX names {name!r}, which is no source; the sources are {', '.join(names)}")
        if name in weights:
            raise MixError(f"DATA_MIX gives {name!r} two weights")
        weights[name] = weight
    missing = [n for n in names if n not in weights]
    if missing:
        raise MixError(f"DATA_MIX gives no weight to {', '.join(missing)} (0 leaves a source out)")
    total = sum(weights.values())
    if total <= 0:
        raise MixError("DATA_MIX: the weights sum to 0")
    return [weights[n] / total for n in names]


def epochs_per_source(total_tokens: float, weights: list[float], source_tokens: list[int]) -> list[float]:
    """How many times each source is seen when `total_tokens` are drawn by `weights`."""
    return [total_tokens * w / max(n, 1) for w, n in zip(weights, source_tokens)]


class MixedWindows:
    """The global sequence of (source, first token within that source's range) of a mixture.

    `lengths` are the sources' training tokens; a window is seq_len + 1 tokens at stride seq_len,
    from an offset drawn per source and epoch (0 in epoch 0), visited in a per-source, per-epoch
    permutation, as the unmixed iterator does over the whole stream."""

    def __init__(self, lengths: list[int], weights: list[float], seq_len: int, seed: int, state: dict | None = None):
        self.lengths, self.seq_len, self.seed = lengths, seq_len, seed
        self.weights = np.asarray(weights, dtype=np.float64)
        for n, w in zip(lengths, weights):
            if w > 0 and (n - 1) // seq_len < 1:
                raise MixError(f"a source of {n} tokens holds no training window of {seq_len + 1} tokens")
        self.cursor = state["cursor"] if state else 0
        # Per source: [epoch, windows of that epoch already given].
        self.positions = [list(p) for p in state["positions"]] if state else [[0, 0] for _ in lengths]
        self._chunk: tuple[int, np.ndarray | None] = (-1, None)
        self._layouts: dict[int, tuple[int, int, np.ndarray]] = {}  # source -> (epoch, offset, order)

    def state(self) -> dict:
        return {"cursor": self.cursor, "positions": [list(p) for p in self.positions]}

    def _sources(self, chunk: int) -> np.ndarray:
        if self._chunk[0] != chunk:
            rng = np.random.default_rng([self.seed, SOURCE_STREAM, chunk])
            self._chunk = (chunk, rng.choice(len(self.weights), size=CHUNK, p=self.weights))
        return self._chunk[1]

    def _layout(self, source: int, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, window order) of one source's epoch."""
        cached = self._layouts.get(source)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, source, epoch])
            cached = (epoch, *window_layout(self.lengths[source], self.seq_len, rng, epoch))
            self._layouts[source] = cached
        return cached[1], cached[2]

    def take(self, count: int) -> list[tuple[int, int]]:
        """The next `count` windows of the global sequence: (source, first token within the source)."""
        out = []
        for _ in range(count):
            source = int(self._sources(self.cursor // CHUNK)[self.cursor % CHUNK])
            position = self.positions[source]
            offset, order = self._layout(source, position[0])
            if position[1] >= len(order):  # the source's epoch is done: reshuffle it
                position[0], position[1] = position[0] + 1, 0
                offset, order = self._layout(source, position[0])
            out.append((source, offset + int(order[position[1]]) * self.seq_len))
            position[1] += 1
            self.cursor += 1
        return out


class MixedBatches:
    """(x, y) micro-batches drawn by source weight: the mixed counterpart of batches.TokenBatches.

    Each micro-step takes the next world_size * batch_size windows of the global sequence and rank r
    reads block r of them, so the ranks never overlap and the state is the same on every rank.
    `ranges` are the sources' [start, stop) in the training tokens."""

    def __init__(self, tokens: np.ndarray, ranges: list[tuple[int, int]], weights: list[float], seq_len: int,
                 batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, state: dict | None = None):
        self.tokens, self.starts, self.seq_len = tokens, [a for a, _ in ranges], seq_len
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.windows = MixedWindows([b - a for a, b in ranges], weights, seq_len, seed, state)

    def state(self) -> dict:
        return self.windows.state()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.windows.take(self.world_size * self.batch_size)
        mine = step[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return window_batch(self.tokens, [self.starts[s] + w for s, w in mine], self.seq_len)


def source_weights(meta: dict, data_mix: str | None) -> list[float] | None:
    """The weights of a prepared corpus's sources (meta["source_splits"]): DATA_MIX's, else by
    training tokens. None for a corpus of one source, where there is nothing to weigh."""
    splits = meta.get("source_splits") or []
    names = [s["name"] for s in splits]
    if data_mix:
        weights = parse_mix(data_mix, names)
    else:
        sizes = [s["train"][1] - s["train"][0] for s in splits]
        weights = [n / max(sum(sizes), 1) for n in sizes]
    return weights if len(splits) > 1 else None
