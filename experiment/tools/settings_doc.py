"""docs/settings.md, generated from TrainConfig: every training setting, its env override, flag and default.

    python -m experiment.tools.settings_doc > docs/settings.md

tests/tools/test_settings_doc.py fails when the committed page and the code disagree.
"""

from __future__ import annotations

import dataclasses
import sys

from experiment.config import CPU_DEFAULTS, CPU_DEVICE_BATCH, CUDA_DEFAULTS, TrainConfig
from experiment.optim import LRS

# What experiment/run.sh itself reads (not TrainConfig fields): the launch, not the training.
LAUNCHER = (
    ("NPROC_PER_NODE", "visible GPUs, or 1 without CUDA", "processes per node"),
    ("NNODES", "1", "nodes; more than 1 uses the c10d rendezvous at MASTER_ADDR:MASTER_PORT"),
    ("NODE_RANK", "0", "this node's rank; node 0 prepares the data"),
    ("MASTER_ADDR", "unset", "node 0's address (needed when NNODES > 1)"),
    ("MASTER_PORT", "29500", "rendezvous port"),
    ("MAX_RESTARTS", "3", "torchrun restarts of all workers after a worker dies; each resumes the latest checkpoint "
                     "(none after a failure the trainer decided: a failed final save, a diverging run)"),
    ("SHUTDOWN_TIMEOUT", "sized by the pre-flight", "seconds torchrun waits after SIGTERM/SIGINT before it kills the "
     "workers; unset: on GPUs twice the predicted save (the checkpoint at 0.3 GB/s) plus a minute, at least 300"),
    ("PREFLIGHT_WAIT_MINUTES", "120", "how long a node other than 0 waits for node 0's pre-flight"),
    ("PYTHON", "`.venv`'s python (created and installed on first use)", "the interpreter the launcher runs; a given "
     "one (or an active venv's) must hold requirements.txt's pinned versions, else the launch exits 2 naming them"),
    ("PYTHON_CHECK", "1", "0: run a given PYTHON without checking its versions against requirements.txt (gpucheck's "
     "end-to-end run uses it on a GPU box whose own torch is not the pin)"),
    ("ON_EXIT", "unset", "a shell command run once when the launch ends (once torchrun has started: a pre-flight "
                "refusal exits 2 first), with RUN_STATUS, RUN_OUTCOME, RUN_DIR, BEST_CHECKPOINT, BEST_EXPORT (best.pt, "
                "when written) and BEST_VAL_LOSS set (output: on_exit.log in the run directory)"),
    ("SWEEP", "unset", "several runs side by side, one per GPU: members separated by spaces, a member's settings by "
                       "+ (`DEPTH=8 DEPTH=12+WEIGHT_DECAY=0.2`); the budget counts the whole box (docs/sweep.md)"),
    ("SWEEP_TAG", "sweep", "the sweep's directory under $WORKSPACE/checkpoints/, its members' run directories in it"),
    ("SWEEP_PARALLEL", "visible GPUs, or 1 without CUDA", "members that run at once, each on one GPU"),
    ("SWEEP_ALLOW_IDLE", "unset", "1: run a sweep that leaves paid GPUs idle (fewer members than GPUs, or a last wave "
                                  "not full); unset, it exits 2 saying the dollars idle"),
    ("SWEEP_ENSEMBLE_TOKENS", "1048576", "val tokens the ensembles of the best 2, 4 and all members are scored on when "
                                         "the sweep ends (in sweep.md); 0: none"),
)

HEADER = """# Settings

Every training setting is an environment override of `bash experiment/run.sh` (and so of `bash run.sh`),
named like its flag in upper case, and a flag of `python -m experiment.train`. Unset means the default
for the device the run is on: the first value with CUDA, the second without.
`python -m experiment.train --help` prints the same list. This page is generated from the code
(`python -m experiment.tools.settings_doc > docs/settings.md`); a test keeps the two in step.
"""


def default(field: dataclasses.Field) -> str:
    if field.default == "":
        return "empty"
    if field.default is not None:
        return f"`{field.default}`"
    if field.name in CUDA_DEFAULTS:
        return f"`{CUDA_DEFAULTS[field.name]}` / `{CPU_DEFAULTS[field.name]}`"
    if field.name in LRS:
        return f"`{LRS[field.name]}` / by depth"
    if field.name == "device_batch_size":
        return f"largest that fits / `{CPU_DEVICE_BATCH}`"
    return "unset"


def render() -> str:
    rows = ["| env | flag | default (CUDA / CPU) | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(TrainConfig):
        meaning = f.metadata["help"].replace("|", "\\|").replace("<", "&lt;")
        rows.append(f"| `{f.name.upper()}` | `--{f.name}` | {default(f)} | {meaning} |")
    launcher = ["| env | default | meaning |", "|---|---|---|"]
    launcher += [f"| `{name}` | {value} | {meaning} |" for name, value, meaning in LAUNCHER]
    return (HEADER + "\n## Training\n\n" + "\n".join(rows) + "\n\n## The launcher (experiment/run.sh only)\n\n"
            + "\n".join(launcher) + "\n")


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
