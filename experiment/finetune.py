"""INIT_FROM: a fresh run that starts from a trained model's weights (nanoGPT's init_from), to go on
training it on new text.

INIT_FROM names a best.pt (an export), a model_<step>.pt or a run directory (its best step). The new
run keeps that model's shape (depth, width, heads, the bigram table) and its tokenizer: a character
model's vocabulary is its own characters, so the new data is prepared with exactly those ids and
a character outside them is refused at the pre-flight, naming each one. The optimizer state, the
LR schedule, the budget and the step count start afresh, as in nanoGPT; the run directory is a new
one (MODEL_TAG, by default the source run's tag with "-ft"). A restart of the new run is the same
command: it resumes the new run's own checkpoints, and INIT_FROM, still read for the shape and the
vocabulary, must name the same source (its weights are not loaded again).
"""

from __future__ import annotations

import re
import dataclasses
from pathlib import Path

from experiment import checkpoint as ckpt
from experiment.checkpoint import CheckpointError
from experiment.config import ConfigError, TrainConfig
from experiment.model import GPTConfig

# TrainConfig fields that the source model fixes, from its model_config. A field left at its parse
# default (None, or DEPTH's "auto") takes the source's value; another value is refused.
SHAPE = {"depth": lambda mc: mc["depth"], "aspect_ratio": lambda mc: mc["aspect_ratio"],
         "head_dim": lambda mc: mc["head_dim"], "bigram_embed": lambda mc: int(mc["bigram_vocab"] > 0)}


def source(cfg: TrainConfig) -> tuple[Path, dict] | None:
    """INIT_FROM's model file and its meta (nothing loaded but the meta); None when unset."""
    if not cfg.init_from:
        return None
    try:
        path = ckpt.resolve_serving_checkpoint(Path(cfg.init_from), Path("."))
        return path, ckpt.model_meta(path)
    except (CheckpointError, OSError, KeyError) as e:
        raise ConfigError(f"--init_from {cfg.init_from}: {e}") from None


def apply(cfg: TrainConfig) -> TrainConfig:
    """Before resolve: the source's shape and tokenizer, its context unless MAX_SEQ_LEN is given, and
    MODEL_TAG <source tag>-ft unless given. ConfigError for a setting that contradicts the source."""
    src = source(cfg)
    if src is None:
        return cfg
    path, meta = src
    mc, tok = meta["model_config"], meta["tokenizer"]
    changes = {}
    for name, value in SHAPE.items():
        given = getattr(cfg, name)
        if given in (None, "auto"):
            changes[name] = value(mc)
        elif given != value(mc):
            raise ConfigError(f"--{name} {given}: INIT_FROM's model ({path}) has {name} {value(mc)}; leave it unset")
    theirs = "char" if tok["tokenizer"] == "char" else tok["encoding"]
    if cfg.tokenizer not in ("char", theirs):  # "char" is also the flag's default: taken as unset
        raise ConfigError(f"--tokenizer {cfg.tokenizer}: INIT_FROM's model ({path}) uses {theirs}; leave it unset")
    changes["tokenizer"] = theirs
    if cfg.max_seq_len is None:
        changes["max_seq_len"] = mc["max_seq_len"]
    if cfg.model_tag is None:
        # a generation's tag is <run>/gen<k>: the fine-tune is a run of its own beside <run>, not inside it
        tag = re.sub(r"/gen\d+$", "", meta.get("train_config", {}).get("model_tag") or "model")
        changes["model_tag"] = f"{tag}-ft"
    return dataclasses.replace(cfg, **changes)


def chars(cfg: TrainConfig) -> str | None:
    """The fixed character vocabulary the new data is prepared with (None: found in the data)."""
    src = source(cfg)
    return src[1]["tokenizer"]["chars"] if src and src[1]["tokenizer"]["tokenizer"] == "char" else None


def check_dir(cfg: TrainConfig, run_dir: Path) -> None:
    """The new run writes elsewhere than the source (else it would resume the source run), and a run
    directory that already holds a fine-tune was started from this same source."""
    if not cfg.init_from:
        return
    path = Path(source(cfg)[0]).resolve()
    if path.parent == Path(run_dir).resolve():
        raise ConfigError(f"--init_from {cfg.init_from}: that is this run's own directory ({run_dir}); set MODEL_TAG "
                          "to a new name for the fine-tuned run")
    steps = ckpt.complete_steps(run_dir) if Path(run_dir).is_dir() else []
    started = steps and ckpt.read_meta(run_dir, steps[-1])["train_config"].get("init_from")
    if started and Path(started).resolve() != Path(cfg.init_from).resolve():
        raise ConfigError(f"--init_from {cfg.init_from}: {run_dir} holds a run started from {started}; set MODEL_TAG "
                          "to a new name for another fine-tune")


def check_target(cfg: TrainConfig, config: GPTConfig) -> None:
    """The new run builds the source's model (the context may differ: RoPE's tables are not weights)."""
    path, meta = source(cfg)
    theirs = {k: v for k, v in meta["model_config"].items() if k != "max_seq_len"}
    ours = {k: v for k, v in config.to_dict().items() if k != "max_seq_len"}
    if theirs != ours:
        raise ConfigError(f"--init_from {cfg.init_from}: its model {theirs} differs from the one this data builds "
                          f"{ours}")


def weights(cfg: TrainConfig) -> tuple[dict, str]:
    """The source's state_dict (memory-mapped, in its saved dtype) and the line that says so."""
    path, meta = source(cfg)
    model, meta = ckpt.load_model(path)
    val = meta.get("val_loss")
    loss = "-" if val is None else f"{val:.4f}"  # a step saved without an eval has none
    return model.state_dict(), (f"init | weights from {path} (step {meta.get('step', '?')}, val_loss {loss} on its own "
                                "data): a fresh optimizer, LR schedule and budget")
