"""What the device is and how fast a piece of work runs on it: peak FLOP/s by name, peak memory, a
drained timing. Looked up or measured, never guessed; the trainer, DEPTH=auto and the tools share it.
"""

from __future__ import annotations

import gc
import os
import resource
import time

import torch

from experiment.distributed import sync

# Network volumes of GPU clouds write about 200-400 MB/s (RunPod's documentation); the low end.
DISK_WRITE_GBPS = 0.3

# Dense bf16 peak FLOP/s by device-name fragment, most specific first. An unknown device reports no
# MFU rather than a wrong one.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 SXM", 989e12), ("H100 80GB HBM3", 989e12),
              ("H200", 989e12), ("A100", 312e12))
# The bus bandwidth a gradient all-reduce gets between the GPUs of one node, GB/s. Assumed, not
# measured here: PCIe cards without NVLink bridges talk over PCIe Gen5 through the host (NCCL's
# all-reduce bus bandwidth on such 8-GPU boxes is commonly reported near 20 GB/s); SXM boards over
# NVLink (H100 SXM: 450 GB/s per direction; taken as 350 achieved).
PCIE_GBPS, NVLINK_GBPS = 20.0, 350.0


def link_gbps(device_name: str) -> float:
    return PCIE_GBPS if "pcie" in device_name.lower() else NVLINK_GBPS  # e.g. "NVIDIA A100-PCIE-40GB"


def peak_flops(device_name: str) -> float | None:
    for fragment, flops in PEAK_FLOPS:
        if fragment.lower() in device_name.lower():
            return flops
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory so far: the caching allocator's on CUDA, the process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def host_available_bytes() -> int:
    """Host memory available to new allocations now (MemAvailable: free plus reclaimable page cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # free pages: a lower bound


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mean_seconds(device: torch.device, n: int, fn, *args) -> float:
    """Seconds per call of n calls queued back to back, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    sync(device)
    return (time.perf_counter() - t0) / n
