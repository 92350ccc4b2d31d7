"""What the pre-flight and every rank derive alike from a TrainConfig: the data the run trains on,
the model config at a depth, the depth to build, and the checks a resume target must pass.

The pre-flight (experiment/preflight.py) runs them once before torchrun starts; train.py runs the
same functions on its ranks (under experiment/run.sh the data is the pre-flight's prepared
directory, opened as is), so the two agree by construction.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from experiment import autosize
from experiment import checkpoint as ckpt
from experiment import finetune
from experiment.config import ConfigError, TrainConfig, fill_lrs
from experiment.dataloader import DataError, Prepared, prepare, write_demo_corpus
from experiment.records import is_data_file
from experiment.model import GPTConfig
from experiment.onexit import last_words


def prepare_data(cfg: TrainConfig, workspace: Path, log) -> Prepared:
    """The data the run trains on: --prepared_dir as given, else DATA_DIR (or <workspace>/data, or the
    built-in demo when that holds no data file) prepared now (a cache hit when unchanged)."""
    if cfg.prepared_dir:
        directory = Path(cfg.prepared_dir)
        if not (directory / "meta.json").is_file():
            raise DataError(f"--prepared_dir {directory}: no prepared data there (meta.json missing); "
                            "leave PREPARED_DIR unset to prepare DATA_DIR")
        return Prepared.load(directory)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else workspace / "data"
    if uses_demo(cfg, workspace):
        data_dir = write_demo_corpus(workspace / "demo_data").parent
        log(f"no data files in {workspace / 'data'}: training on the built-in arithmetic demo ({data_dir})")
    return prepare(data_dir, workspace, cfg.tokenizer, cfg.alphabet, cfg.val_fraction, cfg.max_seq_len,
                   chars=finetune.chars(cfg), text_field=cfg.text_field)


def uses_demo(cfg: TrainConfig, workspace: Path) -> bool:
    """True when the run trains on the built-in demo: no DATA_DIR or PREPARED_DIR, and no data file
    (*.txt, *.jsonl, ...) in <workspace>/data."""
    data_dir = workspace / "data"
    return (cfg.data_dir is None and cfg.prepared_dir is None
            and not (data_dir.is_dir() and any(is_data_file(p.name) for p in data_dir.rglob("*"))))


# In the run directory, each a flock that lives as long as its holder (the kernel drops it when the
# process exits or is killed): experiment/run.sh holds the first for the launch, rank 0 of the
# trainer the second for its own life, which can outlast a killed launcher by the seconds its last
# save takes.
LOCK_FILES = (".lock", ".lock.trainer")


def check_not_running(run_dir: Path) -> None:
    """ConfigError naming the holder when a launch or a trainer holds one of the run directory's
    locks (a second trainer on the same checkpoints would interleave its steps with the first's).
    After a crash or a kill -9 the locks are gone and the same command goes on."""
    for name in LOCK_FILES:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        with open(path, "a+") as f:
            if not _try_lock(f):
                f.seek(0)
                holder = f.read().strip() or "a process that has not said who it is"
                raise ConfigError(f"{run_dir} is in use by a running launch ({holder}); wait for it, stop it, or "
                                  "choose another MODEL_TAG")
            fcntl.flock(f, fcntl.LOCK_UN)


def hold_trainer_lock(run_dir: Path):
    """Rank 0: take the run directory's trainer lock for this process's life (keep the returned
    file open); ConfigError if another trainer holds it."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    f = open(Path(run_dir) / LOCK_FILES[1], "a+")
    if not _try_lock(f):
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise ConfigError(f"{run_dir} is in use by another trainer ({holder}); wait for it or stop it")
    f.truncate(0)
    f.write(f"trainer pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    f.flush()
    return f


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


# torchrun restarts every worker that exits non-zero (MAX_RESTARTS times). A launch the trainer itself
# ended (a user's mistake found at the start, a final save the volume refused, a diverging loss)
# would then set up again, or resume and train up to the same failure again, each time: the hours
# since the latest checkpoint, over and over. So its workers leave a marker for their torchrun agent
# (named by host, the agent's pid, which restarted workers share, the worker's own pid, and the exit
# code the launch ends with: 2 for a mistake, 1 for a failure), and a restarted worker that finds it
# exits at once.
# experiment/agent.py, the agent experiment/run.sh starts, then ends the launch with that code. The
# marker is an empty file: it needs an inode and a directory entry but no data block, which a volume
# full of data still has. experiment/run.sh deletes this host's markers before each launch, and a
# first attempt deletes its own (a container's torchrun may get the same pid every time).
ENDED_PREFIX = ".ended."
# Set by experiment/agent.py for its workers: a restart of an ended launch may exit 0 (one restart,
# then the agent exits with the marker's code) instead of 1 (which a bare torchrun needs to fail).
AGENT_READS_ENDED = "LAUNCH_AGENT_READS_ENDED"


def _marker_name(agent_pid: int) -> str:
    return f"{ENDED_PREFIX}{socket.gethostname()}.{agent_pid}."


def end_launch(run_dir: Path, code: int = 1) -> None:
    """Every rank whose trainer ended the launch (code 2: the user's mistake; 1: a failure): no restart
    of this launch sets up or trains again."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not under torchrun: nothing restarts this process
        return
    try:
        (Path(run_dir) / f"{_marker_name(os.getppid())}{os.getpid()}.{code}").touch()
    except OSError:  # a volume out of inodes, or gone: torchrun then restarts as before
        pass


def _markers(run_dir: Path, agent_pid: int) -> list[tuple[int, int, Path]]:
    """(worker pid, exit code, path) of each marker the workers of agent `agent_pid` on this host left."""
    prefix, found = _marker_name(agent_pid), []
    for marker in Path(run_dir).glob(prefix + "*"):
        try:
            pid, code = map(int, marker.name[len(prefix):].split("."))
        except ValueError:  # not one of ours
            continue
        found.append((pid, code, marker))
    return found


def ended_code(run_dir: Path, agent_pid: int) -> tuple[int, float] | None:
    """(exit code, time) of the marker that the workers of agent `agent_pid` on this host left; None
    when they left none."""
    found = []
    for _, code, marker in _markers(run_dir, agent_pid):
        try:
            found.append((code, marker.stat().st_mtime))
        except OSError:  # gone meanwhile
            continue
    return max(found, key=lambda f: f[0] == 2, default=None)  # a mistake's code over a failure's


def marker_codes(run_dir: Path, agent_pid: int) -> dict[int, int]:
    """{worker pid: exit code} of the markers the workers of agent `agent_pid` on this host left: a
    failure of a worker that left none, or another code (a restart that crashed after the launch was
    ended), is no decision of the trainer's."""
    return {pid: code for pid, code, _ in _markers(run_dir, agent_pid)}


def clear_markers(run_dir: Path, agent_pid: int) -> None:
    """The markers of agent `agent_pid` on this host: an earlier launch's, when its torchrun had this pid."""
    for marker in Path(run_dir).glob(_marker_name(agent_pid) + "*"):
        marker.unlink(missing_ok=True)


def launch_ended(run_dir: Path) -> float | None:
    """When this process is one of torchrun's restarts after its trainer ended the launch
    (end_launch): the time the marker was left; else None. Under experiment/agent.py, which removed
    its pid's markers before it started any worker, every attempt reads them: a restart for a
    membership change (another node re-joined while this node's worker, marker left, still ran) keeps
    TORCHELASTIC_RESTART_COUNT at 0. Under a bare torchrun a first attempt removes a marker that a
    reused pid left from an earlier launch."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        if os.environ.get(AGENT_READS_ENDED) != "1" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            clear_markers(run_dir, os.getppid())
            return None
        found = ended_code(run_dir, os.getppid())
        return found[1] if found else None
    except OSError:  # an unreadable run directory: train, and let the trainer say what is wrong
        return None


def not_restarting(run_dir: Path, ended: float | None, master: bool) -> int:
    """A restart of a launch that a trainer ended (some rank's launch_ended): nothing to set up or train
    again. Rank 0 says why, unless it was the user's mistake, whose error line came once already.
    Returns 0 where experiment/agent.py reads this node's marker (it then ends the launch with the
    marker's code, after this one restart), else 1: a bare torchrun must see the failure."""
    found = ended_code(run_dir, os.getppid()) if ended is not None else None
    if master and (found is None or found[0] != 2):
        print(f"error: not restarting: the trainer ended this launch with a failure that a restart would repeat "
              f"({(ended and last_words(run_dir, ended - 60)) or 'its outcome is not on record'}; training.log "
              f"in {run_dir} says more)", file=sys.stderr, flush=True)
    return 0 if found is not None and os.environ.get(AGENT_READS_ENDED) == "1" else 1


def end_record(run_dir: Path, code: int, outcome: str) -> None:
    """The launch's last words in <run_dir>/metrics.jsonl, as a run that ends leaves them (ON_EXIT's outcome)."""
    try:
        with open(Path(run_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"kind": "end", "outcome": outcome, "code": code, "time": time.time()}) + "\n")
    except OSError:  # a full disk: ON_EXIT then reads the launch as failed, as for a crash
        pass


def end_mistake(run_dir: Path, error: Exception, master: bool) -> None:
    """A user's mistake the trainer met before the launch's first model trained (error.at_start, set
    by train.run): a restart would meet it again, so it ends the launch, with exit 2, and rank 0
    leaves the outcome ON_EXIT reports."""
    if getattr(error, "at_start", False):
        end_launch(run_dir, 2)
        if master:
            end_record(run_dir, 2, f"failed: {error}")


def clear_ended(run_dir: Path) -> None:
    """Rank 0 of a launch that trains: earlier launches' markers are stale."""
    for p in Path(run_dir).glob(ENDED_PREFIX + "*"):
        try:
            p.unlink(missing_ok=True)
        except OSError:  # only a restart of its own launch ever reads one
            pass


EVAL_PROMPT_TOKENS = 32  # the default eval prompt: this many tokens from the start of the val split


def eval_prompt_ids(cfg: TrainConfig, prepared: Prepared) -> list[int]:
    """The token ids every eval's sample continues: EVAL_PROMPT, else the start of the val split."""
    if cfg.eval_prompt is None:
        return [int(t) for t in prepared.tokens("val")[:EVAL_PROMPT_TOKENS]]
    tok = prepared.tokenizer()
    try:
        ids = tok.encode(cfg.eval_prompt) or [tok.bos_id]
    except ValueError as e:
        raise ConfigError(f"--eval_prompt: {e}") from None
    return ids[-cfg.max_seq_len :]


def default_pass_cap(cfg: TrainConfig, prepared: Prepared, run_dir: Path, resume_step: int | None) -> tuple[float, bool]:
    """(What MAX_EPOCHS unset means for this run, whether it is the checkpoint's): a resumed run keeps
    the cap it started with (a changed TOTAL_BATCH_SIZE or a newer rule must not move a schedule
    already under way; 0 stays no cap), a fresh one takes the cap that follows the data
    (autosize.pass_cap)."""
    if resume_step is not None:
        kept = ckpt.read_meta(run_dir, resume_step)["train_config"].get("max_epochs")
        if kept is not None:
            return kept, True
    return autosize.pass_cap(prepared.meta["split"]["train_tokens"], cfg.total_batch_size), False


def fill_pass_cap(cfg: TrainConfig, prepared: Prepared, run_dir: Path, resume_step: int | None, log) -> float:
    """MAX_EPOCHS unset: set it to default_pass_cap, where the data and the resume step are first
    known (the pre-flight, and rank 0 of the trainer, which hands it to the others); a fresh cap
    is said (autosize.cap_lines). Returns the default cap (the pre-flight's repeat guard)."""
    default, kept = default_pass_cap(cfg, prepared, run_dir, resume_step)
    if cfg.max_epochs is None:
        cfg.max_epochs = default
        for line in [] if kept else autosize.cap_lines(default, prepared.meta["split"]["train_tokens"],
                                                       cfg.total_batch_size):
            log(line)
    return default


def model_config(cfg: TrainConfig, prepared: Prepared) -> GPTConfig:
    return GPTConfig(vocab_size=prepared.meta["vocab_size"], depth=cfg.depth, aspect_ratio=cfg.aspect_ratio,
                     head_dim=cfg.head_dim, max_seq_len=cfg.max_seq_len,
                     bigram_vocab=prepared.meta["vocab_used"] if cfg.bigram_embed else 0)


def fill_rates(cfg: TrainConfig, cuda: bool, run_dir: Path, resume_step: int | None, log) -> None:
    """The learning rates left unset: a resume keeps its checkpoint's (config.fill_lrs), and says so
    where they differ from today's defaults."""
    kept = ckpt.read_meta(run_dir, resume_step)["train_config"] if resume_step is not None else None
    if moved := fill_lrs(cfg, cuda, kept):
        log("resume | learning rates kept from the checkpoint, not today's defaults: "
            + ", ".join(f"{name.upper()}={lr:g}" for name, lr in moved.items()))


def check_resume_target(run_dir: Path, step: int, config: GPTConfig, prepared: Prepared) -> None:
    """A checkpoint resumes only the same model on the same data."""
    meta = ckpt.read_meta(run_dir, step)
    if meta["model_config"] != config.to_dict():
        raise ConfigError(f"{ckpt.meta_path(run_dir, step)}: model config {meta['model_config']} differs "
                          f"from the requested {config.to_dict()}; use another --model_tag")
    if meta["prepared"]["hash"] != prepared.meta["hash"]:
        raise ConfigError(f"{ckpt.meta_path(run_dir, step)}: trained on prepared data "
                          f"{meta['prepared']['hash']}, but the data now hashes to {prepared.meta['hash']}")


def depth_for(cfg: TrainConfig, run_dir: Path, resume_step: int | None) -> int | None:
    """The depth to build: DEPTH as given, or with DEPTH=auto the resumed checkpoint's (a resume keeps
    the choice); None for a fresh auto run, which chooses at start from measured throughput."""
    if cfg.depth != "auto":
        return cfg.depth
    return None if resume_step is None else ckpt.read_meta(run_dir, resume_step)["model_config"]["depth"]


def make_config(cfg: TrainConfig, prepared: Prepared):
    """depth -> the GPTConfig of this run's shape at that depth."""
    return lambda depth: model_config(dataclasses.replace(cfg, depth=depth), prepared)


def spent_base(meta: dict, world_size: int) -> float:
    """RunState.gpu_seconds_base for a resume of `meta`'s step on `world_size` ranks: the GPU-seconds
    its launches spent stay spent, whatever the GPU count from here on."""
    st = ckpt.run_state(meta)
    return st.gpu_seconds_base + st.used_seconds * (meta.get("world_size", world_size) - world_size)


def dollar_budget(cfg: TrainConfig, run_dir: Path, resume_step: int | None, world_size: int, log,
                  gpu_fix: float = 0.0) -> None:
    """BUDGET_USD on a resume: the budget seconds on these `world_size` GPUs that spend what the
    earlier launches left of the dollars (config.resolve's budget_usd / (rate x GPUs) holds only while
    the GPU count never changed). An 8-GPU run resumed on 4 gets twice the hours left, not twice the
    dollars. `gpu_fix`: restarts.lost_on_other_gpus."""
    if cfg.budget_usd is None or resume_step is None:
        return
    meta = ckpt.read_meta(run_dir, resume_step)
    base, used = spent_base(meta, world_size) + gpu_fix, ckpt.run_state(meta).used_seconds
    seconds = (cfg.budget_usd * 3600 / cfg.gpu_hourly_usd - base) / world_size
    cfg.training_hours = max(seconds, used) / 3600  # spent already: the run ends at once
    if meta.get("world_size", world_size) != world_size or base:
        spent = (base + used * world_size) * cfg.gpu_hourly_usd / 3600
        log(f"budget | ${spent:,.2f} of BUDGET_USD=${cfg.budget_usd:,.2f} spent by earlier launches (on "
            f"{meta.get('world_size')} GPU(s) last): {max(seconds - used, 0) / 3600:.3f} h left on {world_size}")


def launch_started() -> float:
    """When the budget's clock starts for this process: experiment/run.sh's start (LAUNCH_STARTED:
    its pre-flight, data preparation and torchrun's start are on the renter's bill too) on a
    launch's first attempt; now on one of torchrun's restarts (the restart's own setup is its cost)
    and without run.sh."""
    now = time.time()
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return now
    try:
        started = float(os.environ.get("LAUNCH_STARTED", ""))
    except ValueError:
        return now
    return started if now - 86400 < started <= now else now  # a stale or foreign value: ignored
