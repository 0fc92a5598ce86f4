"""Where a command runs: rank and world size under torchrun, the device, and the mixed precision it uses."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .errors import UserError


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


def resolve_device(name: Optional[str], local_rank: int = 0) -> torch.device:
    """A ``--device`` value as a torch.device with its index: None → cuda:LOCAL_RANK when there is a GPU, else cpu;
    ``cuda`` → cuda:LOCAL_RANK. A name that is not cpu/cuda[:N], or a GPU this machine lacks, is a UserError
    naming the flag (PyTorch's own messages come later and do not say which setting was wrong)."""
    if name is None:
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UserError(f"--device {name}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: PyTorch sees no CUDA GPU here (torch {torch.__version__}); "
                        f"use --device cpu")
    index = local_rank if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: there is no cuda:{index}; PyTorch sees {torch.cuda.device_count()} "
                        f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return torch.device("cuda", index)


def setup_runtime(mixed_precision: bool, device: Optional[str] = None) -> Runtime:
    """The device (default: cuda:LOCAL_RANK when there is a GPU), and the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Runtime(rank, world_size, dev, autocast_dtype(dev, mixed_precision))


def linear_warmup_decay(optimizer: torch.optim.Optimizer, total_steps: int,
                        warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The fine-tuning schedule of BERT/RoBERTa (GLUE) and LRA (ListOps): the learning rate rises linearly to the
    optimizer's rate over `warmup_steps` (step s runs at (s + 1) / warmup_steps of it), then falls linearly to 0 at
    `total_steps`. Pretraining keeps the paper's one-cycle schedule instead (pretrain.py)."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def barrier(rt: Runtime) -> None:
    if rt.world_size > 1:
        dist.barrier()
