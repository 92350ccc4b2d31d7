"""Where the server (and sample) runs and what it loads: the device (CPU, CUDA or Apple's MPS), the
KV cache's default size from the memory left free, and the line that names the checkpoints served.
Shared by experiment/server.py and experiment/sample.py."""

from __future__ import annotations

import dataclasses

import torch

from experiment.distributed import resolve_device
from experiment.engine import KVSlots
from experiment.model import GPTConfig
from experiment.hardware import host_available_bytes


# The share of the memory free after the model loads that the KV cache takes by default: the rest is
# for the decode step's activations and logits, prefill, and whatever else the machine runs. A d32
# checkpoint's 32 slots (512 MiB each in bf16) would otherwise ask a 16 GB laptop for 16 GiB at start.
KV_SHARE = 0.5


def serving_device(flag: str) -> torch.device:
    """--device auto|cpu|cuda|mps: the trainer's choice (auto: CUDA where it is), plus Apple's MPS on
    request; asking for a device that is not there is a ValueError naming it."""
    if flag == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError("--device mps, but MPS is not available here (Apple silicon with a torch built for it)")
        return torch.device("mps")
    return resolve_device(flag)


def free_bytes(device: torch.device) -> int | None:
    """Memory new allocations can take now: the GPU's free memory on CUDA; on MPS what Metal recommends
    less what torch holds; else the host's available memory; None where the machine does not say
    (a host without /proc/meminfo whose sysconf lacks the free-page count, as macOS)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        return torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory()
    try:
        return host_available_bytes()
    except (OSError, ValueError):
        return None


def auto_kv_cache_gib(device: torch.device, slot_bytes: int) -> tuple[float | None, str]:
    """The default KV-cache cap, KV_SHARE of the free memory (None, no cap, where the machine does not
    say how much is free), and the words the server says it in."""
    free = free_bytes(device)
    if free is None:
        return None, "every --max_batch slot: this machine does not say how much memory is free (--kv_cache_gib caps it)"
    if KV_SHARE * free < slot_bytes:
        raise ValueError(f"half of the {free / 2**30:.2f} GiB free on {device.type} holds no KV-cache slot "
                         f"({slot_bytes / 2**20:.1f} MiB each for this model): free memory, or set --kv_cache_gib")
    return KV_SHARE * free / 2**30, f"sized to half of the {free / 2**30:.1f} GiB free on {device.type} (--kv_cache_gib sets it)"


def served_line(members) -> str:
    """Each checkpoint served, with its step and val loss: `<path> (step N, val_loss x) + ...`."""
    return " + ".join(f"{path} (step {meta['step']}, val_loss "
                      + ("n/a (saved at a preemption, without an eval)" if meta["val_loss"] is None
                         else f"{meta['val_loss']:.4f}") + ")" for meta, path in members)



# Decode speed of one request (the KV-cache path) on a 2-core CPU, tokens/s, the best of fp32 and bf16 at 1
# and 2 threads, fresh models of a GPU run's shape (width 64 per layer, heads of 128, context 2048, vocabulary
# 128): `bench generate --depth D --dtype X --threads N --naive 0` (docs/serving.md, "Speed"). Other
# depths are scaled from the nearest by the weights a decode step multiplies (decode_weights).
CPU_DECODE_TOK_S = {12: 34.4, 20: 11.3}  # fp32 at 2 threads, the best of the four; reports/serve-cpu-2026-11-27.md
CPU_DECODE_VOCAB = 128
CPU_DECODE_MACHINE = "a 2-core CPU VM (fp32 matmul peak 293 GFLOP/s)"


def decode_weights(config: GPTConfig, vocab: int) -> int:
    """The weights one decode step multiplies: the blocks' matrices (12 x width^2 per layer) and the
    output head; the embedding tables are looked up, a row per token."""
    return 12 * config.n_layer * config.n_embd**2 + vocab * config.n_embd


def serving_needs(config: GPTConfig, params: int, chars_per_token: float) -> dict:
    """What serving a model of this shape needs: memory for its bf16 weights (`params`, the tables
    included) and one request's KV slot (each more concurrent request adds one), and the characters
    per second one request decodes on CPU_DECODE_MACHINE: measured at its depths, scaled elsewhere."""
    nearest = min(CPU_DECODE_TOK_S, key=lambda d: (abs(d - config.depth), d))
    ref = dataclasses.replace(config, depth=nearest)
    tok_s = CPU_DECODE_TOK_S[nearest] * decode_weights(ref, CPU_DECODE_VOCAB) / decode_weights(
        config, config.vocab_size)
    slot = KVSlots.bytes_per_slot(config, torch.bfloat16)
    return {"serve_gb": (2 * params + slot) / 1e9, "kv_slot_gb": slot / 1e9,
            "cpu_chars_per_s": tok_s * chars_per_token, "cpu_measured": nearest == config.depth}
