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

import sys
from pathlib import Path


from experiment import checkpoint as ckpt
from experiment.dataloader import Prepared
from experiment.distributed import resolve_device
from experiment.ensembles import check_same_data, compare
from experiment.files import default_workspace


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
    check_same_data([(meta, path) for _, meta, path in members])
    first = members[0][1]
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
    tokens = prepared.tokens("val")
    r = compare(members, tokens, args.k, len(tokens))
    print(f"ensemble | {r['tokens']:,} val tokens, every whole {members[0][0].config.max_seq_len}-token window "
          f"of {prepared.dir}")
    for m in r["members"]:
        print(f"ensemble | member {m['path']}: {m['loss']:.4f}")
    for e in r["ensembles"]:
        print(f"ensemble | best {e['k']}: {e['loss']:.4f} ({e['gain']:+.4f} against the best member)")
    return 0
