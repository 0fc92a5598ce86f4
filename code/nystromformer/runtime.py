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


def check_environment() -> None:
    """The NYSTROM_* switches of the Nyström attention, checked when a command starts: they are read at each
    forward, where a misspelt value would fail only after the data and model are loaded (or, on the CPU, where
    NYSTROM_TRITON, NYSTROM_OVERLAP, NYSTROM_RECOMPUTE and NYSTROM_LAUNCH_SETTINGS are not read at all, be
    ignored)."""
    from .attention import nystrom, nystrom_fast
    nystrom.use_fast_path(torch.empty(0), "auto")
    nystrom_fast.triton_mode()
    nystrom_fast.overlap_mode()
    nystrom_fast.recompute_mode()
    nystrom_fast.launch_settings()


def _env_int(name: str, default: int, low: int) -> int:
    text = os.environ.get(name)
    try:
        value = default if text is None else int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise UserError(f"{name}={text}: expected an integer >= {low} (set by torchrun; unset it to run one process)")
    return value


def distributed_environment() -> tuple:
    """(world size, rank, local rank) from torchrun's variables, checked: a stray or partial set (a cluster's
    exported RANK, WORLD_SIZE without torchrun) would otherwise fail deep inside torch.distributed."""
    world_size = _env_int("WORLD_SIZE", 1, 1)
    rank, local_rank = _env_int("RANK", 0, 0), _env_int("LOCAL_RANK", 0, 0)
    if rank >= world_size:
        raise UserError(f"RANK={rank} with WORLD_SIZE={world_size}: a rank must be below the world size (run "
                        f"several processes with torchrun, or unset RANK)")
    if world_size > 1:
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise UserError(f"WORLD_SIZE={world_size} without {', '.join(missing)}: start the processes with "
                            f"torchrun (make pretrain NPROC={world_size}), which sets them")
    return world_size, rank, local_rank


def setup_runtime(mixed_precision: bool, device: Optional[str] = None) -> Runtime:
    """The device (default: cuda:LOCAL_RANK when there is a GPU), and the process group under torchrun."""
    check_environment()
    world_size, rank, local_rank = distributed_environment()
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        if rank == 0:  # init waits for every process: say so, rather than sit silent
            print(f"waiting for the {world_size} processes to join at {os.environ['MASTER_ADDR']}:"
                  f"{os.environ['MASTER_PORT']}", flush=True)
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
