"""Sample from a trained model on the command line, streaming to stdout.

    python -m experiment.sample --checkpoint PATH --prompt TEXT --max_tokens N   (or: bash run.sh sample ...)

The checkpoint resolves as the server resolves it: a run directory (its best checkpoint), a
model_<step>.pt (that step, also when it was saved in per-rank parts), an export (best.pt), or nothing (the best of the
newest run under the workspace). Decoding is the server's (experiment/engine.py): with the same
prompt, settings and seed, a sample is the completion the server returns. Sample i of a prompt uses
seed + i. Lines about the checkpoint go to stderr, the text to stdout.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment.config import opt, parse_flags
from experiment.dataloader import tokenizer_from_meta
from experiment.engine import generate, prompt_ids
from experiment.files import default_workspace
from experiment.model import DTYPES
from experiment.servemem import served_line, serving_device

SEPARATOR = "-" * 40  # between samples, as nanoGPT's sample.py prints them


@dataclass
class SampleConfig:
    checkpoint: str | None = opt("a run directory (its best), a model_<step>.pt (that step), an export (best.pt), or unset: the "
                                 "newest run's best; several, separated by commas: an ensemble (the mean of their "
                                 "next-token probabilities)")
    prompt: str = opt("the text the samples continue (empty: from the start of a document)", "")
    prompt_file: str | None = opt("a file of prompts, one per line; \\n in a line stands for a newline")
    num_samples: int = opt("samples per prompt", 1)
    max_tokens: int = opt("new tokens per sample", 256)
    temperature: float = opt("0 is greedy", 0.8)
    top_k: int | None = opt("sample from the k most likely tokens only (default: all)")
    top_p: float | None = opt("nucleus sampling: the smallest set of tokens with this much probability")
    seed: int = opt("sample i of a prompt uses seed + i", 1337)
    device: str = opt("where the model runs (mps: Apple silicon, where torch has it)", "auto",
                      choices=("auto", "cpu", "cuda", "mps"))
    dtype: str = opt("weights dtype; auto: the checkpoint's own", "auto", choices=("auto", *DTYPES))
    workspace: str | None = opt("where to look for runs (default as in run.sh)")


def read_prompts(cfg: SampleConfig) -> list[str]:
    if cfg.prompt_file is None:
        return [cfg.prompt]
    try:
        lines = Path(cfg.prompt_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt_file {cfg.prompt_file}: cannot read it ({e})") from None
    if not lines:
        raise ValueError(f"--prompt_file {cfg.prompt_file}: no prompt in it (one per line)")
    return [line.replace("\\n", "\n") for line in lines]


def check(cfg: SampleConfig) -> None:
    """ValueError naming the flag of a setting that cannot work."""
    if cfg.num_samples < 1 or cfg.max_tokens < 1:
        raise ValueError(f"--num_samples and --max_tokens must be >= 1, got {cfg.num_samples} and {cfg.max_tokens}")
    if cfg.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {cfg.temperature}")
    if cfg.top_k is not None and cfg.top_k < 1:
        raise ValueError(f"--top_k must be >= 1, got {cfg.top_k}")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise ValueError(f"--top_p must lie in (0, 1], got {cfg.top_p}")


class Stream:
    """Writes a sample's text as its tokens arrive: each new token's text once it is whole (a BPE
    token can end inside a multi-byte character, which decodes as U+FFFD until the next one)."""

    def __init__(self, tok, out=sys.stdout):
        self.tok, self.out, self.ids, self.written = tok, out, [], 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        whole = len(text.rstrip("\ufffd"))
        if whole > self.written:
            self.out.write(text[self.written : whole])
            self.out.flush()
            self.written = whole

    def close(self) -> str:
        text = self.tok.decode(self.ids)
        self.out.write(text[self.written :] + "\n")
        self.out.flush()
        return text


def run(cfg: SampleConfig) -> int:
    check(cfg)
    prompts = read_prompts(cfg)
    device = serving_device(cfg.device)
    workspace = Path(cfg.workspace) if cfg.workspace else default_workspace()
    members = ckpt.load_serving(cfg.checkpoint, workspace, device, dtype=None if cfg.dtype == "auto" else DTYPES[cfg.dtype])
    (model, meta, _), models = members[0], [m for m, _, _ in members]
    tok = tokenizer_from_meta(meta["tokenizer"])
    encoded = []
    for prompt in prompts:  # every prompt checked before the first sample is written
        try:
            encoded.append(prompt_ids(tok, prompt, model.config.max_seq_len))
        except ValueError as e:
            raise ValueError(f"prompt {prompt[:40]!r}: {e}") from None
    print(f"sample | {served_line([(m, p) for _, m, p in members])} | {device}", file=sys.stderr)
    for prompt, (ids, dropped) in zip(prompts, encoded):
        if dropped:
            print(f"sample | the prompt's first {dropped} tokens are cut: the model sees its last "
                  f"{model.config.max_seq_len}", file=sys.stderr)
        for i in range(cfg.num_samples):
            sys.stdout.write(prompt)
            stream = Stream(tok)
            gen = torch.Generator().manual_seed(cfg.seed + i)
            for token in generate(models if len(models) > 1 else model, ids, cfg.max_tokens, cfg.temperature,
                                  cfg.top_k, cfg.top_p, gen, tok.n_real):
                stream.add(token)
            stream.close()
            print(SEPARATOR, flush=True)
    return 0


def main(argv=None) -> int:
    cfg = parse_flags(SampleConfig, argv, "python -m experiment.sample", __doc__.split("\n")[0])
    print(f"config {dataclasses.asdict(cfg)}", file=sys.stderr)
    try:
        return run(cfg)
    except (ValueError, ckpt.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
