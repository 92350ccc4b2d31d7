"""One file to download and serve: a run's best model in bf16, with its meta.

    python -m experiment.export [--checkpoint RUN_DIR_OR_FILE] [--out FILE]   (or: bash run.sh export ...)

--checkpoint resolves as the server resolves it: a run directory (its best step), a step's
model_<step>.pt (also when the step was saved in per-rank parts), or unset (the newest run's best).
The step's model files are checked against the sizes and checksums their meta recorded first.
--out defaults to <run directory>/best.pt, the file every run's end writes itself. The server and
`sample` take the file as --checkpoint; it holds no optimizer state, so nothing resumes from it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiment import checkpoint as ckpt
from experiment.config import opt, parse_flags
from experiment.files import default_workspace

@dataclass
class ExportConfig:
    checkpoint: str | None = opt("a run directory (its best), a model_<step>.pt, or unset: the newest run's best")
    out: str | None = opt(f"the file to write (default <run directory>/{ckpt.EXPORT_NAME})")
    workspace: str | None = opt("where unset --checkpoint looks for runs (default as for training)")


def export(checkpoint: str | Path | None, out: str | Path | None, workspace: Path) -> tuple[Path, dict]:
    """(the file written, export_model's facts plus the seconds it took); CheckpointError otherwise."""
    src = ckpt.resolve_serving_checkpoint(checkpoint, workspace)
    out = Path(out) if out else src.parent / ckpt.EXPORT_NAME
    t0 = time.time()
    facts = ckpt.export_model(src, out)
    return out, {**facts, "seconds": time.time() - t0}


def describe(out: Path, facts: dict) -> str:
    return (f"export | step {facts['step']:06d} -> {out} | {facts['bytes'] / 1e9:.3f} GB, bf16 weights and meta | "
            f"{facts['seconds']:.1f}s | serve it: bash run.sh serve --checkpoint {out}")


def main(argv=None) -> int:
    cfg = parse_flags(ExportConfig, sys.argv[1:] if argv is None else argv, "python -m experiment.export",
                      __doc__.split("\n")[0])
    workspace = Path(cfg.workspace) if cfg.workspace else default_workspace()
    try:
        out, facts = export(cfg.checkpoint, cfg.out, workspace)
    except (ckpt.CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(out, facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
