"""Where a command runs: rank and world size under torchrun, the device, and the mixed precision it uses."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    autocast_dtype: Optional[torch.dtype]  # None: full fp32

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def autocast_dtype(device: torch.device, mixed_precision: bool) -> Optional[torch.dtype]:
    """bf16 on a GPU that has it natively (no loss scaling needed), fp16 (with a GradScaler) on older GPUs, None
    (fp32) on the CPU or without mixed precision. Emulated bf16 would be slower than fp16 there."""
    if not mixed_precision or device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def setup_runtime(mixed_precision: bool, device: Optional[str] = None) -> Runtime:
    """The device (default: cuda:LOCAL_RANK when there is a GPU), and the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Runtime(rank, world_size, dev, autocast_dtype(dev, mixed_precision))


def barrier(rt: Runtime) -> None:
    if rt.world_size > 1:
        dist.barrier()
