"""A later generation's teacher: earlier generations' best steps, frozen, their next-token
probabilities the distillation term's targets (model.distillation_loss; experiment/generations.py
picks the steps and records them).

A teacher is loaded from its step's model files, which are checked against the sizes and checksums
their meta recorded (checkpoint.load_model); the meta itself against the digest recorded when the
generation began (a step swapped for another run's is refused), and its data and tokenizer against
the student's: probabilities over other token ids would teach nonsense.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment.checkpoint import CheckpointError
from experiment.dataloader import Prepared
from experiment.distributed import autocast_for
from experiment.model import GPT

TOKENIZER_KEYS = ("tokenizer", "encoding", "chars", "bos_id", "vocab_size")


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16). There a teacher's forward
    in bf16 took about half the time of fp32's (docs/performance.md, "A cheaper teacher"); elsewhere
    (no such unit, another architecture, a torch without the query) the teacher stays fp32."""
    try:
        caps = torch.cpu.get_capabilities()
    except Exception:  # the query is missing or fails: fp32 is always right, only slower
        return False
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def meta_digest(model_file: Path) -> str:
    """sha256 of the meta file of the step `model_file` names: what a generation's record keeps of
    its teacher (the meta lists every model file's size and checksum, so this pins the weights)."""
    m = ckpt.MODEL_RE.match(Path(model_file).name)
    if not m:
        raise CheckpointError(f"{model_file}: a teacher is a step's model file (model_<step>.pt)")
    path = ckpt.meta_path(Path(model_file).parent, int(m.group(1)))
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise CheckpointError(f"teacher {model_file}: cannot read its meta ({e})") from e


class Teacher:
    """Frozen models in eval mode (no dropout); probs() is the mean of their probabilities at the
    temperature (of probabilities, not logits: an ensemble of probabilities measured better in
    NanoGPT Slowrun's unlimited track, and one member is the same either way). Their forward runs in
    the trainer's precision on CUDA (bf16 autocast) and in bf16 autocast on a CPU with native bf16
    (`cpu_bf16`; None asks native_cpu_bf16()), where the student stays fp32: a target needs less
    precision than a gradient. Weights, logits and probabilities stay fp32 on CPU."""

    def __init__(self, models: list[GPT], temperature: float, cpu_bf16: bool | None = None):
        self.models, self.temperature = models, temperature
        self.cpu_bf16 = native_cpu_bf16() if cpu_bf16 is None else cpu_bf16
        for m in models:
            m.eval().requires_grad_(False)
        self.run = list(models)  # what probs() calls: the models, or their compiled wrappers

    @classmethod
    def load(cls, members: list[dict], prepared: Prepared, device: torch.device, temperature: float,
             max_seq_len: int) -> "Teacher":
        """`members`: the generation record's teachers, each {"generation", "file", "meta_sha256"}."""
        models = []
        for member in members:
            path = Path(member["file"])
            name = f"teacher gen{member['generation']} ({path})"
            if meta_digest(path) != member["meta_sha256"]:
                raise CheckpointError(f"{name}: its meta is not the one recorded when this generation began "
                                      "(the step was replaced or damaged); restore it, or start the run afresh")
            # bf16 on CUDA, where autocast runs its matmuls in bf16 anyway: half the memory of an fp32
            # generation's weights beside the student (memory.plan_memory counts 2 bytes a parameter)
            model, meta = ckpt.load_model(path, device, torch.bfloat16 if device.type == "cuda" else None)
            if meta["prepared"]["hash"] != prepared.meta["hash"]:
                raise CheckpointError(f"{name}: trained on other data (prepared hash {meta['prepared']['hash'][:12]}, "
                                      f"this run's {prepared.meta['hash'][:12]})")
            theirs = {k: meta["tokenizer"].get(k) for k in TOKENIZER_KEYS}
            if theirs != {k: prepared.meta.get(k) for k in TOKENIZER_KEYS}:
                raise CheckpointError(f"{name}: another tokenizer than this run's data")
            if model.config.max_seq_len < max_seq_len:
                raise CheckpointError(f"{name}: its context {model.config.max_seq_len} is shorter than this run's "
                                      f"max_seq_len {max_seq_len}")
            models.append(model)
        return cls(models, temperature)

    @classmethod
    def for_run(cls, cfg, device: torch.device, prepared: Prepared, members: list[dict], log) -> "Teacher":
        """A generation's teacher (train.setup), loaded, checked and said in one line."""
        teacher = cls.load(members, prepared, device, cfg.distill_temperature, cfg.max_seq_len)
        log(f"teacher | {' + '.join(m['file'] for m in members)} | {teacher.num_params():,} params, frozen | "
            f"loss (1 - {cfg.distill_weight:g}) x labels + {cfg.distill_weight:g} x T^2 x KL(teacher || model), "
            f"T {cfg.distill_temperature:g} | forward in {teacher.precision(device)}")
        return teacher

    def compile(self) -> None:
        self.run = [torch.compile(m, dynamic=False) for m in self.models]

    def precision(self, device: torch.device) -> str:
        """What the forward computes in on `device`: the log line's word."""
        return "bf16" if device.type == "cuda" or (device.type == "cpu" and self.cpu_bf16) else "fp32"

    def autocast(self, device: torch.device):
        if device.type == "cpu":
            return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cpu_bf16)
        return autocast_for(device)

    @torch.no_grad()
    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, V) fp32: the members' mean probability of each next token given x."""
        total = None
        with self.autocast(x.device):
            for run in self.run:
                p = torch.softmax(run(x) / self.temperature, dim=-1)
                total = p if total is None else total + p
        return total / len(self.run)

    def num_params(self) -> int:
        return sum(m.num_params() for m in self.models)

    def flops_per_token(self) -> float:
        """The members' forward passes: a third of each one's training FLOPs (GPT.estimate_flops)."""
        return sum(m.estimate_flops() for m in self.models) / 3
