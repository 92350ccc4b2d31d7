"""Batches from the prepared token memmaps: the trainer's resumable, disjoint-per-rank iterator over
the training split (TokenBatches; experiment/mixture.py draws a DATA_MIX from the same windows),
and the eval's fixed sample of the val split."""

from __future__ import annotations

import numpy as np
import torch

from experiment.dataloader import DataError


class TokenBatches:
    """Resumable (x, y) micro-batches, disjoint across ranks by construction.

    The token stream is cut into non-overlapping windows of seq_len + 1 tokens (stride seq_len, an
    offset drawn per epoch), visited in a per-epoch permutation that every rank computes from the
    same seed. A global cursor counts windows consumed by all ranks: each micro-step takes the next
    world_size * batch_size windows and rank r reads block r of them. So no window is seen twice in
    an epoch, the ranks never overlap, and the state (epoch, cursor) is the same on every rank.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, state: dict | None = None):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.cursor = (state["epoch"], state["cursor"]) if state else (0, 0)
        self._layout()
        if self.n_windows < world_size * batch_size:
            raise DataError(
                f"training split holds {self.n_windows} sequences of {seq_len + 1} tokens, fewer than one "
                f"micro-step needs (world_size {world_size} x device_batch_size {batch_size})"
            )

    def _layout(self) -> None:
        rng = np.random.default_rng([self.seed, self.epoch])
        self.offset, self.order = window_layout(len(self.tokens), self.seq_len, rng, self.epoch)
        self.n_windows = len(self.order)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.world_size * self.batch_size
        if self.cursor + step > self.n_windows:  # drop the ragged tail, reshuffle
            self.epoch, self.cursor = self.epoch + 1, 0
            self._layout()
        first = self.cursor + self.rank * self.batch_size
        starts = self.offset + self.order[first : first + self.batch_size] * self.seq_len
        self.cursor += step
        return window_batch(self.tokens, starts, self.seq_len)


def window_layout(n_tokens: int, seq_len: int, rng: np.random.Generator, epoch: int) -> tuple[int, np.ndarray]:
    """(offset, order) of one epoch over n_tokens: windows of seq_len + 1 tokens at stride seq_len
    from an offset drawn after the first epoch (0 where a shift would leave no window), visited in a
    permutation. Shared by the unmixed iterator and each source of a mixture."""
    offset = int(rng.integers(seq_len)) if epoch > 0 else 0
    if (n_tokens - offset - 1) // seq_len < 1:
        offset = 0
    return offset, rng.permutation((n_tokens - offset - 1) // seq_len)


def window_batch(tokens: np.ndarray, starts, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of the windows of seq_len + 1 tokens at `starts`: inputs and next-token targets."""
    batch = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))  # (B, T + 1)
    return batch[:, :-1], batch[:, 1:]


def val_windows(n_tokens: int, seq_len: int, max_tokens: int) -> list[int]:
    """The eval sample's window starts: every whole window of the split when max_tokens holds them
    all, else max_tokens // seq_len of them at even strides from the first window to the last, the
    same at every eval. A slice of the first tokens would read one stretch of the text: on Tiny
    Shakespeare the first 65,536 val tokens read about 0.09 nats below the whole split."""
    k, n = val_window_count(n_tokens, seq_len, max_tokens)
    return [i * (n - 1) // max(k - 1, 1) * seq_len for i in range(k)]


def val_window_count(n_tokens: int, seq_len: int, max_tokens: int) -> tuple[int, int]:
    """(windows the eval sample reads, whole windows in the split): at least one, at most all."""
    n = (n_tokens - 1) // seq_len
    return min(n, max(1, max_tokens // seq_len)), n


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int,
                rank: int = 0, world_size: int = 1):
    """The fixed eval sample (val_windows) in batches; window i goes to rank i % world."""
    mine = val_windows(len(tokens), seq_len, max_tokens)[rank::world_size]
    for i in range(0, len(mine), batch_size):
        yield window_batch(tokens, mine[i : i + batch_size], seq_len)
