"""MLM pretraining driven by a model folder's config.json, with exact resume and from_cp warm starts.

    nystromformer pretrain --model-dir nystrom-512          # or: cd nystrom-512 && python ../code/run_pretrain.py
    torchrun --nproc_per_node 8 code/run_pretrain.py --model-dir nystrom-512

Re-running the same command resumes from the newest complete checkpoint. SIGTERM (preemption,
``docker stop``) finishes the current step, writes ``step-NNNNNNNN.cp`` and exits with status 143
(torchrun, if it receives the signal itself, exits with 1).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import checkpoint
from .cli import add_subcommand, script_main
from .config import Config, ConfigError, load_config
from .jsonlog import JsonLog
from .mlm import (STREAM_DROPOUT, STREAM_MASK, SampleOrder, derived_seed, evaluate, generator, mask_tokens,
                  micro_batches, padding_mask)
from .model import NystromformerForMaskedLM
from .shards import ShardedSequences, ShardError

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: "stopped before finishing", so restart policies retry
LOG_NAME = "pretrain_output.log"


@dataclass
class Runtime:
    """Where this process runs: rank and world size under torchrun, device, and precision."""
    rank: int
    world_size: int
    device: torch.device
    autocast_dtype: Optional[torch.dtype]  # None: full fp32

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_runtime(cfg: Config, device: Optional[str] = None) -> Runtime:
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
    autocast_dtype = None
    if cfg.model.mixed_precision and dev.type == "cuda":
        # bf16 needs no loss scaling; older GPUs get fp16 with a GradScaler.
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        autocast_dtype = torch.bfloat16 if native_bf16 else torch.float16
    return Runtime(rank, world_size, dev, autocast_dtype)


class PreemptionFlag:
    """Set by SIGTERM (or by --stop-at-step); checked between steps so a step is never cut in half."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, rt: Runtime) -> bool:
        if rt.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        return bool(flag.item())


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    ps = cfg.pretraining_setting
    return torch.optim.AdamW(model.parameters(), lr=ps.learning_rate, betas=(0.9, 0.999), eps=ps.adam_eps,
                             weight_decay=ps.weight_decay, fused=device.type == "cuda")


def build_scheduler(optimizer, cfg: Config):
    # The paper's OneCycle schedule: linear warm-up over `warmup` of all steps, then linear decay.
    # Momentum cycling is off: with Adam it would rewrite beta1.
    ps = cfg.pretraining_setting
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=ps.learning_rate, total_steps=ps.epoch * ps.batches_per_epoch, pct_start=ps.warmup,
        anneal_strategy="linear", cycle_momentum=False)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# Keys that may change between a run and its resumption: they do not change what is computed.
RESUME_MAY_CHANGE = {
    "model": {"attention_grad_checkpointing", "gelu_grad_checkpointing", "mixed_precision"},
    "pretraining_setting": {"batches_per_report", "validate_batches_per_epoch"},
    "gpu_setting": {"inst_per_gpu", "compile"},
}


def check_resumable_config(saved: Optional[dict], cfg: Config, path: str) -> None:
    """Refuse to resume under a config that changes the run (schedule, data position, architecture): the
    resumed run would silently differ from the one it continues."""
    if not saved:
        return
    current = cfg.to_dict()
    for section in ("model", "pretraining_setting", "gpu_setting"):
        for key, old in saved.get(section, {}).items():
            new = current[section].get(key)
            if old != new and key not in RESUME_MAY_CHANGE[section]:
                raise ConfigError(
                    f"{section}.{key}: is {json.dumps(new)} but {path} was trained with {json.dumps(old)}; "
                    f"resuming would not continue that run. Restore the value, or start a new model folder with "
                    f'"from_cp" pointing at this checkpoint')


def _check_same_step_on_every_rank(step: int, rt: Runtime) -> None:
    steps = torch.tensor([step, -step], device=rt.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    if steps[0].item() != -steps[1].item():
        raise checkpoint.CheckpointError(
            f"ranks resumed from different steps (between {-steps[1].item()} and {steps[0].item()}): every node "
            f"must see the same checkpoint folder")


def check_data(cfg: Config, data: ShardedSequences) -> None:
    meta = data.meta
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's vocabulary "
                          f"({meta['vocab_size']} in {data.folder / 'meta.json'})")
    if meta["max_seq_len"] > cfg.model.max_seq_len:
        raise ConfigError(f"model.max_seq_len: {cfg.model.max_seq_len} is shorter than the data's sequences "
                          f"({meta['max_seq_len']} in {data.folder / 'meta.json'})")
    if meta["special_tokens"]["pad"] != cfg.model.pad_token_id:
        raise ConfigError(f"model.pad_token_id: {cfg.model.pad_token_id} differs from the data's pad id "
                          f"{meta['special_tokens']['pad']} ({data.folder / 'meta.json'})")


def pretrain(cfg: Config, device: Optional[str] = None, stop_at_step: Optional[int] = None,
             show_progress: bool = True) -> int:
    rt = setup_runtime(cfg, device)
    ps = cfg.pretraining_setting
    say = print if rt.is_main else (lambda *a, **k: None)
    if ps.batch_size % rt.world_size:
        raise ConfigError(f"pretraining_setting.batch_size: {ps.batch_size} is not divisible by the "
                          f"{rt.world_size} processes")
    train = ShardedSequences(cfg.data_dir, "train")
    check_data(cfg, train)
    dev_path = cfg.data_dir / "dev.json"
    dev = ShardedSequences(cfg.data_dir, "dev") if ps.validate_batches_per_epoch and dev_path.is_file() else None
    special, vocab_size = train.meta["special_tokens"], train.meta["vocab_size"]

    ckpt_dir = cfg.checkpoint_dir
    if rt.is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    log = JsonLog(ckpt_dir / LOG_NAME, rt.is_main)

    torch.manual_seed(ps.seed)  # the same initial weights on every rank
    model = NystromformerForMaskedLM(cfg.model).to(rt.device)
    optimizer = build_optimizer(model, cfg, rt.device)
    scheduler = build_scheduler(optimizer, cfg)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.autocast_dtype == torch.float16)

    step = 0
    if rt.is_main:
        checkpoint.remove_stale_temp_files(ckpt_dir)
    state = checkpoint.load_newest_resumable(ckpt_dir, ps.batches_per_epoch, log=say)
    if state is not None:
        check_resumable_config(state.get("config"), cfg, state["path"])
        model.load_state_dict(state["model_state_dict"])
        optimizer.load_state_dict(state["optimizer_state_dict"])
        scheduler.load_state_dict(state["scheduler_state_dict"])
        if state["scaler_state_dict"] and scaler.is_enabled():  # empty when saved by a bf16 or CPU run
            scaler.load_state_dict(state["scaler_state_dict"])
        set_rng_state(state["rng_state"])
        step = state["step"]
        say(f"resuming from {state['path']} at step {step} (epoch {step // ps.batches_per_epoch})")
        log.truncate_after(step)
        log.write(type="resume", step=step, checkpoint=state["path"])
    elif cfg.from_cp:
        source = cfg.path(cfg.from_cp)
        say(f"warm start from {source}")
        checkpoint.load_pretrained_weights(model, source, cfg.model.max_seq_len, log=say)
        log.truncate_after(0)
        log.write(type="warm_start", step=0, checkpoint=str(source))
    else:
        log.truncate_after(0)

    if cfg.gpu_setting.compile != "none":
        # In place (state_dict keys unchanged). Only the encoder: the MLM head's masked-position gather has a
        # data-dependent shape, which would make CUDA graphs re-record every step.
        model.encoder.compile(mode=cfg.gpu_setting.compile)
        say(f"encoder compiled with torch.compile(mode={cfg.gpu_setting.compile!r}); the first steps include "
            f"compilation")
    ddp_model = model
    if rt.world_size > 1:
        _check_same_step_on_every_rank(step, rt)
        # Reformer's shared-QK attention leaves the key projection without a gradient.
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
            find_unused_parameters=cfg.model.attn_type == "reformer")

    order = SampleOrder(len(train), ps.seed)
    per_rank = ps.batch_size // rt.world_size
    micro = min(cfg.gpu_setting.inst_per_gpu, per_rank)
    total_steps = ps.epoch * ps.batches_per_epoch
    preemption = PreemptionFlag()
    say(f"pretraining {cfg.model.attn_type} model: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{len(train):,} training sequences of {train.seq_len} tokens, {rt.world_size} process(es) on "
        f"{rt.device.type}, micro-batch {micro} x {-(-per_rank // micro)} accumulation step(s), "
        f"precision {rt.autocast_dtype or torch.float32}")

    def state_dict() -> dict:
        return {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
                "scheduler_state_dict": scheduler.state_dict(), "scaler_state_dict": scaler.state_dict(),
                "rng_state": rng_state(), "epoch": step // ps.batches_per_epoch, "step": step,
                "inst_pass": step * ps.batch_size, "config": cfg.to_dict()}

    model.train()
    if stop_at_step is not None and step >= stop_at_step and step < total_steps:
        say(f"already at step {step} >= --stop-at-step {stop_at_step}; nothing to do")
        return PREEMPTED_EXIT_CODE
    while step < total_steps:
        epoch = step // ps.batches_per_epoch
        bar = tqdm(total=ps.batches_per_epoch, initial=step % ps.batches_per_epoch, desc=f"epoch {epoch}",
                   disable=not (rt.is_main and show_progress), mininterval=1.0, dynamic_ncols=True)
        while True:
            t0 = time.perf_counter()
            ids = torch.from_numpy(train.rows(order.indices(step * ps.batch_size, ps.batch_size)))
            inputs, labels = mask_tokens(ids, generator(ps.seed, STREAM_MASK, step), ps.mask_prob, special, vocab_size)
            total_masked = max(int((labels != -100).sum()), 1)
            mine = slice(rt.rank * per_rank, (rt.rank + 1) * per_rank)
            inputs, labels = inputs[mine], labels[mine]
            attention_mask = padding_mask(inputs, special["pad"])  # None for full-length rows (no padding)
            inputs, labels = inputs.to(rt.device), labels.to(rt.device)
            if attention_mask is not None:
                attention_mask = attention_mask.to(rt.device)
            torch.manual_seed(derived_seed(ps.seed, STREAM_DROPOUT, step, rt.rank))

            totals = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, correct
            chunks = list(micro_batches(per_rank, micro))
            for i, chunk in enumerate(chunks):
                sync = i == len(chunks) - 1 or rt.world_size == 1
                ctx = ddp_model.no_sync() if not sync else contextlib.nullcontext()
                with ctx, torch.autocast(rt.device.type, dtype=rt.autocast_dtype or torch.bfloat16,
                                         enabled=rt.autocast_dtype is not None):
                    out = ddp_model(inputs[chunk], labels[chunk],
                                    attention_mask=None if attention_mask is None else attention_mask[chunk])
                    # Normalise by the global masked count: the gradient is that of the mean over the whole
                    # batch however it is split (DDP averages over ranks, hence the world_size factor).
                    loss = out.loss_sum * (rt.world_size / total_masked)
                    scaler.scale(loss).backward()
                totals += torch.stack([out.loss_sum.detach().double(), out.num_correct.double()])
            if ps.max_grad_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), ps.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if rt.world_size > 1:
                dist.all_reduce(totals)
            step += 1
            seconds = time.perf_counter() - t0
            loss_value, accu = totals[0].item() / total_masked, totals[1].item() / total_masked
            log.write(type="train", epoch=epoch, step=step, loss=loss_value, mlm_accu=accu, lr=lr, time=seconds,
                      inst_pass=step * ps.batch_size, tokens_per_s=ps.batch_size * train.seq_len / seconds)
            bar.update(1)
            if step % ps.batches_per_report == 0:
                bar.set_postfix(loss=f"{loss_value:.4f}", accu=f"{accu:.3f}", lr=f"{lr:.2e}")

            if step % ps.batches_per_epoch == 0:
                break
            if (stop_at_step is not None and step >= stop_at_step) or preemption.agreed(rt):
                bar.close()
                if rt.is_main:
                    path = checkpoint.save_preempted(ckpt_dir, state_dict())
                    log.write(type="preempted", step=step, checkpoint=str(path))
                    say(f"stopped at step {step}; wrote {path}. Run the same command again to resume.")
                _barrier(rt)
                return PREEMPTED_EXIT_CODE
        bar.close()

        # Checkpoint first: a preemption's grace period (10 s for `docker stop`) may not cover the dev pass.
        if rt.is_main:
            checkpoint.save_epoch(ckpt_dir, epoch, state_dict())
        _barrier(rt)
        preempted = preemption.agreed(rt)
        stopping = preempted or (stop_at_step is not None and step >= stop_at_step)
        if dev is not None and not preempted:
            metrics = evaluate(model, dev, ps.validate_batches_per_epoch * ps.batch_size, micro, ps.seed,
                               ps.mask_prob, rt.device, rt.autocast_dtype, rt.rank, rt.world_size)
            log.write(type="dev", epoch=epoch, step=step, **metrics)
            say(f"epoch {epoch}: dev loss {metrics['loss']:.4f}, dev MLM accuracy {metrics['mlm_accu']:.4f}")
        if stopping and step < total_steps:
            skipped = " (dev evaluation skipped: `validate` fills it in)" if preempted and dev is not None else ""
            say(f"stopped after epoch {epoch}{skipped}; run the same command again to resume.")
            _barrier(rt)
            return PREEMPTED_EXIT_CODE
    say(f"pretraining finished: {step} steps; checkpoints in {ckpt_dir}")
    _barrier(rt)  # every rank past its last collective before any of them tears the process group down
    return 0


def _barrier(rt: Runtime) -> None:
    if rt.world_size > 1:
        dist.barrier()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=".", help="model folder holding config.json (default: current directory)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda:LOCAL_RANK when available, else cpu)")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="stop after this global step as if preempted (writes a resumable checkpoint)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.model_dir)
        return pretrain(cfg, device=args.device, stop_at_step=args.stop_at_step, show_progress=not args.no_progress)
    except (ConfigError, ShardError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            # DDP's reducer holds the process group: free it now (it may sit in a reference cycle) rather than at
            # interpreter exit, where gloo's worker threads tearing down aborted a rank now and then (SIGABRT,
            # "terminate called without an active exception", seen in CI's two-process test).
            gc.collect()
            dist.destroy_process_group()


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "pretrain", "MLM pretraining of a model folder (resumes automatically)", __doc__, add_arguments, run)


def main(argv=None) -> int:
    return script_main("run_pretrain.py", __doc__, add_arguments, run, argv)
