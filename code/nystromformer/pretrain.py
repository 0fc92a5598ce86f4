"""MLM pretraining driven by a model folder's config.json, with exact resume and from_cp warm starts.

    nystromformer pretrain --model-dir nystrom-512          # or: cd nystrom-512 && python ../code/run_pretrain.py
    torchrun --nproc_per_node 8 code/run_pretrain.py --model-dir nystrom-512

Re-running the same command resumes from the newest complete checkpoint (and says so, writing nothing, when
the run has finished). SIGTERM (preemption, ``docker stop``) or SIGINT (Ctrl-C) finishes the step in progress (and,
under torchrun, possibly the next: the ranks agree on stopping one step later),
writes ``step-NNNNNNNN.cp`` and exits with status 143 or 130 (torchrun, if it receives the signal itself, exits
with 1); a second Ctrl-C stops at once. One run at a time per model folder: a second one is refused.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import inspect
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import atomic, checkpoint, jsonlog
from .cli import add_subcommand, say, script_main
from .config import Config, ConfigError, load_config
from .errors import UserError
from .jsonlog import JsonLog
from .mlm import (DEV_EVAL_VERSION, STREAM_DROPOUT, STREAM_MASK, SampleOrder, accuracy_note, derived_seed,
                  evaluate_fp16_safe, generator, mask_tokens, micro_batches, padding_mask, to_device)
from .model import IGNORE_INDEX, NystromformerForMaskedLM, fixed_weights, masked_positions_of, set_batch_groups
from .resume import (check_data, check_from_cp_location, check_resumable_config, check_resumable_data,
                     check_same_step_on_every_rank, data_fingerprint, dev_point_missing, refuse_to_overwrite_history,
                     rng_state, set_rng_state)
from .runtime import Runtime, barrier, setup_runtime
from .shards import ShardedSequences

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: "stopped before finishing", so restart policies retry
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT (Ctrl-C)
LOG_NAME = "pretrain_output.log"
LOCK_NAME = "pretrain.lock"
# fp16 with a GradScaler skips a step whose loss is not finite (the weights stay as they were), as an fp16
# overflow in the forward pass can hit one batch and not the next; this many in a row is a divergence.
MAX_CONSECUTIVE_SKIPPED_STEPS = 10


class TrainingDiverged(UserError, RuntimeError):
    """The training loss became NaN or infinite."""


class PreemptionFlag:
    """Set by SIGTERM or SIGINT; checked between steps so a step is never cut in half. A context manager: the
    previous handlers come back when the run ends."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0  # the signal received (the larger if both), 0 if none
        self._previous = {}

    def __enter__(self) -> "PreemptionFlag":
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop at once (atomic writes leave no torn checkpoint)
        self.signum = max(self.signum, signum)
        if signum == signal.SIGINT:  # os.write: print is not safe inside a signal handler
            os.write(2, b"\nstopping after the step in progress and writing a checkpoint (Ctrl-C again stops at "
                        b"once)\n")

    def agreed(self, rt: Runtime) -> int:
        """The signal every rank stops for (0: none)."""
        return self.agreement(self.queue_agreement(rt))

    def queue_agreement(self, rt: Runtime) -> Optional[torch.Tensor]:
        """Under DDP, queue the reduction of this rank's signal over all ranks (read by ``agreement``), so that
        every rank stops at the same step; None for a single process."""
        if rt.world_size == 1:
            return None
        flag = torch.full((1,), float(self.signum), device=rt.device)  # a fill: torch.tensor(...) would sync
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def agreement(self, flag: Optional[torch.Tensor]) -> int:
        return self.signum if flag is None else int(flag.item())


@dataclass
class QueuedStep:
    """A training step whose work is queued on the device and whose loss has not been read back yet."""
    step: int  # counted from 1
    started: float  # time.perf_counter() when its batch was prepared
    lr: float
    total_masked: int  # masked tokens in the whole batch (all ranks)
    totals: torch.Tensor  # loss sum and correct predictions (all-reduced under DDP)
    stop_flag: Optional[torch.Tensor]  # DDP: PreemptionFlag.queue_agreement's reduction


LOCK_TAKEN, LOCK_BUSY, LOCK_FAILED = 1, 0, -1
NO_FLOCK_ERRNOS = atomic.NO_FLOCK_ERRNOS


@contextlib.contextmanager
def folder_lock(ckpt_dir, rt: Runtime, config_file="config.json"):
    """Create the checkpoint folder (``model_checkpoints``) and hold an exclusive flock on its lock file (rank 0
    only) while the run lasts; refuse at once if another run holds it. The lock goes with the process, so a killed
    run leaves none behind.
    Under DDP rank 0 broadcasts the outcome, so that a failure there (a read-only folder...) stops every rank
    rather than leaving the others in the next collective until the process group's timeout."""
    path = ckpt_dir / LOCK_NAME
    fd, outcome, problem = None, LOCK_TAKEN, ""
    if rt.is_main:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:  # some cluster file systems (Lustre without -o flock, FUSE) have no flock
                if e.errno not in NO_FLOCK_ERRNOS:
                    raise
                print(f"warning: {path}: this file system does not support locks ({e.strerror}); running without "
                      f"one, so make sure no other run uses {ckpt_dir}", file=sys.stderr, flush=True)
            os.ftruncate(fd, 0)
            os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            outcome, problem = LOCK_BUSY, f"{holder} holds {path}"
        except OSError as e:
            outcome, problem = LOCK_FAILED, f"{type(e).__name__}: {e.strerror or e}"
        if outcome != LOCK_TAKEN and fd is not None:
            os.close(fd)
            fd = None
    if rt.world_size > 1:
        flag = torch.tensor([float(outcome)], device=rt.device)
        dist.broadcast(flag, src=0)  # also the barrier: the folder exists before any rank looks into it
        outcome = int(flag.item())
    problem = problem or "see rank 0's error"
    if outcome == LOCK_BUSY:
        raise checkpoint.CheckpointError(
            f"{ckpt_dir}: another pretraining run is using this model folder ({problem}); wait for it to finish or "
            f"stop it, then run the same command again")
    if outcome == LOCK_FAILED:
        raise checkpoint.CheckpointError(
            f"{config_file}: model_checkpoints: cannot create {ckpt_dir} or take its lock {path} ({problem}); it "
            f"must name a folder this run can write to")
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    ps = cfg.pretraining_setting
    return torch.optim.AdamW(model.parameters(), lr=ps.learning_rate, betas=(0.9, 0.999), eps=ps.adam_eps,
                             weight_decay=ps.weight_decay, fused=device.type == "cuda")


class _OneCycleLR(torch.optim.lr_scheduler.OneCycleLR):
    """OneCycleLR that accepts a warm-up of exactly one step, where torch divides by the warm-up phase's zero
    length: that step is the end of the warm-up, at the peak rate (and, cycling, the lowest beta1). Its state dict
    is OneCycleLR's."""

    def get_lr(self):
        if self.last_epoch == 0 and self._schedule_phases[0]["end_step"] <= 0:  # warm-up of 1 step or less
            for group in self.optimizer.param_groups:
                if self.cycle_momentum:
                    group["betas"] = (group["base_momentum"], *group["betas"][1:])
            return [group["max_lr"] for group in self.optimizer.param_groups]
        return super().get_lr()


def build_scheduler(optimizer, cfg: Config):
    # The paper's OneCycle schedule: linear warm-up over `warmup` of all steps, then linear decay; with torch's
    # default momentum cycling, which for Adam moves beta1 from 0.95 to 0.85 at the peak and back (the authors'
    # run_pretrain.py left it on).
    ps = cfg.pretraining_setting
    return _OneCycleLR(
        optimizer, max_lr=ps.learning_rate, total_steps=ps.epoch * ps.batches_per_epoch, pct_start=ps.warmup,
        anneal_strategy="linear", cycle_momentum=ps.cycle_momentum)


def pretrain(cfg: Config, device: Optional[str] = None, stop_at_step: Optional[int] = None,
             show_progress: bool = True) -> int:
    if stop_at_step is not None and stop_at_step < 1:
        raise ConfigError(f"--stop-at-step: must be at least 1 (a global step), got {stop_at_step}")
    rt = setup_runtime(cfg.model.mixed_precision, device)
    ps = cfg.pretraining_setting
    if ps.batch_size % rt.world_size:
        raise ConfigError(f"{cfg.config_file}: pretraining_setting.batch_size: {ps.batch_size} is not divisible by "
                          f"the {rt.world_size} processes")
    _load_data(cfg)  # its refusals before the lock makes the checkpoint folder: none left behind, empty but for it
    with folder_lock(cfg.checkpoint_dir, rt, cfg.config_file), PreemptionFlag() as preemption:
        run = PretrainRun(cfg, rt, preemption, show_progress)
        stopped = run.restore(stop_at_step)
        return stopped if stopped is not None else run.train(stop_at_step)


def _load_data(cfg: Config) -> tuple[ShardedSequences, Optional[ShardedSequences]]:
    """The training split and, when the config evaluates on it, the dev split, both checked against the config."""
    ps = cfg.pretraining_setting
    train = ShardedSequences(cfg.data_dir, "train")
    check_data(cfg, train)
    data_len, model_len = train.meta["max_seq_len"], cfg.model.max_seq_len
    if data_len < model_len:  # e.g. nystrom-4096 pointed at the 512 shards: it would train at 512 and say nothing
        raise ConfigError(f"{cfg.config_file}: model.max_seq_len: {model_len} is longer than the data's sequences "
                          f"({data_len} in {cfg.data_dir / 'meta.json'}): the positions past {data_len} would never "
                          f"be trained; point data_folder at shards built at {model_len} tokens (build-shards "
                          f"--seq-len {model_len}), or set max_seq_len to {data_len}")
    if not ps.validate_batches_per_epoch:
        return train, None
    dev_path = cfg.data_dir / "dev.json"
    if not dev_path.is_file():  # `validate` needs it too: say so now, not after the first epoch
        raise ConfigError(f"{cfg.config_file}: pretraining_setting.validate_batches_per_epoch: is "
                          f"{ps.validate_batches_per_epoch} but {dev_path} does not exist; add a dev split to "
                          f"the data folder, or set it to 0 to pretrain without dev evaluation")
    dev = ShardedSequences(cfg.data_dir, "dev")
    check_data(cfg, dev, pretraining=True)
    return train, dev


class PretrainRun:
    """One pretraining run of a model folder: its data, model, optimizer and log. ``restore`` resumes from the
    newest checkpoint or warm-starts from ``from_cp``; ``train`` runs the remaining epochs, checkpointing after
    each and on preemption. ``self.step`` counts the optimizer steps done (global steps, from 0)."""

    def __init__(self, cfg: Config, rt: Runtime, preemption: PreemptionFlag, show_progress: bool):
        self.cfg, self.rt, self.preemption, self.show_progress = cfg, rt, preemption, show_progress
        self.ps = ps = cfg.pretraining_setting
        self.say = say if rt.is_main else (lambda *a, **k: None)
        self.train_data, self.dev_data = _load_data(cfg)
        self.special, self.vocab_size = self.train_data.meta["special_tokens"], self.train_data.meta["vocab_size"]
        self.data_id = data_fingerprint(cfg.data_dir, self.train_data)
        self.ckpt_dir = cfg.checkpoint_dir
        self.log = JsonLog(self.ckpt_dir / LOG_NAME, rt.is_main)

        torch.manual_seed(ps.seed)  # the same initial weights on every rank
        self.model = NystromformerForMaskedLM(cfg.model).to(rt.device)
        # The recipe's micro-batch is inst_per_gpu rows (Nyström's init takes its max over each); a pass may run
        # several of them (rows_per_pass).
        set_batch_groups(self.model, cfg.gpu_setting.inst_per_gpu)
        self.ddp_model = self.model  # wrapped by train() under DDP
        self.optimizer = build_optimizer(self.model, cfg, rt.device)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.autocast_dtype == torch.float16)
        self.total_steps = ps.epoch * ps.batches_per_epoch
        self.per_rank = ps.batch_size // rt.world_size
        self.micro = min(cfg.gpu_setting.pass_rows, self.per_rank)
        self.nonfinite = NonFiniteLosses(self.scaler.is_enabled(), self.ckpt_dir, ps.batches_per_epoch)
        self.order = SampleOrder(len(self.train_data), ps.seed)
        self.step = 0

    # ------------------------------------------------------------------------------------------- start
    def restore(self, stop_at_step: Optional[int]) -> Optional[int]:
        """Resume from the newest resumable checkpoint, or start afresh (warm from ``from_cp`` if set). Returns
        the exit status when there is nothing to train, else None."""
        cfg, rt = self.cfg, self.rt
        if rt.is_main:
            checkpoint.remove_stale_temp_files(self.ckpt_dir)
        if cfg.from_cp:
            check_from_cp_location(self.ckpt_dir, cfg.path(cfg.from_cp), self.ps.epoch, cfg.config_file)
        state = checkpoint.load_newest_resumable(self.ckpt_dir, self.ps.batches_per_epoch, log=self.say)
        if rt.world_size > 1:
            check_same_step_on_every_rank(state["step"] if state else 0, rt)
        if state is not None:
            if self._resume(state, stop_at_step):
                return 0
        else:
            self._start_fresh()
        if stop_at_step is not None and stop_at_step <= self.step < self.total_steps:
            self.say(f"already at step {self.step} >= --stop-at-step {stop_at_step}; nothing to do")
            return PREEMPTED_EXIT_CODE
        return None

    def _resume(self, state: dict, stop_at_step: Optional[int]) -> bool:
        """Load a checkpoint's state; returns whether the run had already finished."""
        ps, cfg = self.ps, self.cfg
        check_resumable_config(state.get("config"), cfg, state["path"])
        check_resumable_data(state.get("data"), cfg, self.data_id, state["path"], log=self.say)
        self.model.load_state_dict(state["model_state_dict"])
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        self.scheduler.load_state_dict(state["scheduler_state_dict"])
        if state["scaler_state_dict"] and self.scaler.is_enabled():  # empty when saved by a bf16 or CPU run
            self.scaler.load_state_dict(state["scaler_state_dict"])
        set_rng_state(state["rng_state"])
        self.nonfinite.consecutive = state.get("nonfinite_consecutive", 0)  # not in checkpoints before 2026-11-29
        self.step = step = state["step"]
        finished = step >= self.total_steps
        if not finished:
            self.log.truncate_after(step)
            if stop_at_step is None or step < stop_at_step:  # a rerun of the same stop trains and logs nothing
                self.say(f"resuming from {state['path']} at step {step} (epoch {step // ps.batches_per_epoch})")
                self.log.write(type="resume", step=step, checkpoint=state["path"])
        older = [e for e in jsonlog.read(self.log.path) if e.get("type") == "dev"
                 and e.get("eval_version") != DEV_EVAL_VERSION] if self.log.path.is_file() and self.rt.is_main else []
        if older:
            say(f"warning: {self.log.path}: {len(older)} dev point(s) were measured by an earlier dev evaluation "
                f"(before 2026-11-23 it took the dev split's first rows, one corpus): not comparable with the ones "
                f"this run adds; `nystromformer validate` measures every checkpoint with the current one")
        # A run stopped between an epoch's checkpoint and its dev evaluation: do that evaluation now.
        if (self.dev_data is not None and step % ps.batches_per_epoch == 0
                and dev_point_missing(self.log.path, step, self.rt)):
            self.evaluate_dev(step // ps.batches_per_epoch - 1, " (the evaluation the stopped run did not do)")
        if finished:
            self.say(f"pretraining already finished: {step} steps in {state['path']}; nothing to do")
        return finished

    def _start_fresh(self) -> None:
        """Step 0: the initial weights, or from_cp's (a warm start); a log of an earlier run is refused."""
        cfg = self.cfg
        source = cfg.path(cfg.from_cp) if cfg.from_cp else None
        refuse_to_overwrite_history(self.ckpt_dir, self.log.path, self.ps.batches_per_epoch, source)
        if source is not None:
            if source.is_dir():
                raise ConfigError(f"{cfg.config_file}: from_cp: {source} is a folder; name a cp-NNNN.model or .cp "
                                  f"file in it")
            if not source.is_file():
                raise ConfigError(f"{cfg.config_file}: from_cp: {source} does not exist (has the run it comes "
                                  f"from written it?)")
            self.say(f"warm start from {source}")
            try:
                checkpoint.load_pretrained_weights(self.model, source, cfg.model.max_seq_len, log=self.say)
            except checkpoint.CheckpointError as e:
                raise checkpoint.CheckpointError(f"{cfg.config_file}: {e} (from_cp: {source})") from None
        self.log.truncate_after(-1)  # an earlier attempt's entries (its warm_start too): this start redoes them all
        if source is not None:
            self.log.write(type="warm_start", step=0, checkpoint=str(source))

    def _prepare_model(self) -> None:
        """torch.compile and the DDP wrapper, after any checkpoint is loaded into the plain model."""
        cfg, rt = self.cfg, self.rt
        if cfg.gpu_setting.compile != "none":
            # In place (state_dict keys unchanged). Only the encoder: the MLM head's masked-position gather has a
            # data-dependent shape, which would make CUDA graphs re-record every step.
            self.model.encoder.compile(mode=cfg.gpu_setting.compile)
            self.say(f"encoder compiled with torch.compile(mode={cfg.gpu_setting.compile!r}); the first steps "
                     f"include compilation")
        if rt.world_size > 1:
            # Reformer's shared-QK attention leaves the key projection without a gradient. Buffers are not
            # broadcast before every forward: each is the same on every rank by construction (Performer's redraws
            # are seeded by its features, its count by the passes every rank makes; BigBird's seed is drawn from
            # the run's seed), and a broadcast per step would make those two read them back from the device (their
            # host copies follow outside writes). torch ≥ 2.13 names this forward_sync_buffers (still synced once,
            # here); its broadcast_buffers is deprecated.
            ddp = torch.nn.parallel.DistributedDataParallel
            no_step_sync = ({"forward_sync_buffers": False}
                            if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
                            else {"broadcast_buffers": False})
            self.ddp_model = ddp(self.model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
                                 find_unused_parameters=cfg.model.attn_type == "reformer", **no_step_sync)

    # ------------------------------------------------------------------------------------------- one step
    def state_dict(self) -> dict:
        ps, step = self.ps, self.step
        return {"model_state_dict": self.model.state_dict(), "optimizer_state_dict": self.optimizer.state_dict(),
                "scheduler_state_dict": self.scheduler.state_dict(), "scaler_state_dict": self.scaler.state_dict(),
                "rng_state": rng_state(), "epoch": max(step - 1, 0) // ps.batches_per_epoch, "step": step,
                "inst_pass": step * ps.batch_size, "config": self.cfg.to_dict(), "data": self.data_id,
                # fp16's skipped steps in a row up to this one: a run of them may span the checkpoint
                "nonfinite_consecutive": self.nonfinite.consecutive}

    def queue_step(self) -> QueuedStep:
        """Prepare batch ``self.step`` + 1 and queue its forward, backward and optimizer step; nothing waits for the
        device here (with fp16, GradScaler.step does: it reads whether the gradients overflowed)."""
        ps, rt, done = self.ps, self.rt, self.step
        started = time.perf_counter()
        ids = torch.from_numpy(self.train_data.rows(self.order.indices(done * ps.batch_size, ps.batch_size)))
        inputs, labels = mask_tokens(ids, generator(ps.seed, STREAM_MASK, done), ps.mask_prob, self.special,
                                     self.vocab_size)
        total_masked = max(int((labels != IGNORE_INDEX).sum()), 1)
        mine = slice(rt.rank * self.per_rank, (rt.rank + 1) * self.per_rank)
        inputs, labels = inputs[mine], labels[mine]
        attention_mask = padding_mask(inputs, self.special["pad"])  # None for full-length rows (no padding)
        chunks = list(micro_batches(self.per_rank, self.micro))
        positions = to_device([masked_positions_of(labels[chunk]) for chunk in chunks], rt.device)
        inputs, labels, attention_mask = to_device((inputs, labels, attention_mask), rt.device)
        torch.manual_seed(derived_seed(ps.seed, STREAM_DROPOUT, done, rt.rank))

        totals = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, correct
        # One autocast region and fixed weights for all the micro-batches: the weights' casts are made once a step.
        with torch.autocast(rt.device.type, dtype=rt.autocast_dtype or torch.bfloat16,
                            enabled=rt.autocast_dtype is not None), fixed_weights(self.model):
            for i, chunk in enumerate(chunks):
                sync = i == len(chunks) - 1 or rt.world_size == 1
                with self.ddp_model.no_sync() if not sync else contextlib.nullcontext():
                    out = self.ddp_model(inputs[chunk], labels[chunk],
                                         attention_mask=None if attention_mask is None else attention_mask[chunk],
                                         masked_positions=positions[i])
                    # Normalise by the global masked count: the gradient is that of the mean over the whole
                    # batch however it is split (DDP averages over ranks, hence the world_size factor).
                    loss = out.loss_sum * (rt.world_size / total_masked)
                    # The backward outside autocast (which would cast its matmuls — attention_fp32's too — to
                    # the low dtype); a nested region keeps the outer one's cache of casts.
                    with torch.autocast(rt.device.type, enabled=False):
                        self.scaler.scale(loss).backward()
                totals += torch.stack([out.loss_sum.detach().double(), out.num_correct.double()])
        if ps.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), ps.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if rt.world_size > 1:
            dist.all_reduce(totals)
        self.step += 1
        return QueuedStep(done + 1, started, lr, total_masked, totals, self.preemption.queue_agreement(rt))

    def report(self, queued: QueuedStep, bar: tqdm, next_started: Optional[float] = None) -> int:
        """Read back a queued step's loss (waiting for that step's work only), check it is finite, log it and
        advance the epoch's progress bar; returns the signal every rank stops for (0: none). ``next_started``: when
        the next step began to be queued, if it has been."""
        ps = self.ps
        loss_sum, correct = queued.totals.tolist()
        signum = self.preemption.agreement(queued.stop_flag)
        # A step's time runs from its start to the next one's (the loop's period: steps overlap on the device), or
        # to this read for the last step queued before a checkpoint.
        seconds = (next_started or time.perf_counter()) - queued.started
        done, epoch = queued.step, (queued.step - 1) // ps.batches_per_epoch
        loss_value, accu = loss_sum / queued.total_masked, correct / queued.total_masked
        if self.nonfinite.check(loss_value, done):  # the same on every rank (all-reduced)
            if self.rt.is_main:
                tqdm.write(f"warning: the training loss is {loss_value} at step {done}; the GradScaler skipped the "
                           f"step ({self.nonfinite.consecutive} in a row; {MAX_CONSECUTIVE_SKIPPED_STEPS} stop the "
                           f"run)", file=sys.stderr)
            self.log.write(type="skipped", epoch=epoch, step=done, loss=str(loss_value), lr=queued.lr)
        else:
            self.log.write(type="train", epoch=epoch, step=done, loss=loss_value, mlm_accu=accu, lr=queued.lr,
                           time=seconds, inst_pass=done * ps.batch_size,
                           tokens_per_s=ps.batch_size * self.train_data.seq_len / seconds)
            if done % ps.batches_per_report == 0:
                # shown by the update below, beside the count that includes this step (not the one before it)
                bar.set_postfix(loss=f"{loss_value:.4f}", accu=f"{accu:.3f}", lr=f"{queued.lr:.2e}", refresh=False)
        bar.update(1)
        return signum

    def evaluate_dev(self, epoch: int, note: str = "") -> None:
        """Evaluate the weights of ``self.step`` on the dev split and log it as epoch ``epoch``'s."""
        ps, rt, step = self.ps, self.rt, self.step
        # (Measured again in fp32 if fp16 overflowed: else the same overflow would stop every rerun here.)
        # Passes of pass_rows, as `validate`'s (not self.micro, which a per-rank batch below pass_rows shrinks):
        # Nyström's pinv init takes its max over each inst_per_gpu rows of a pass, so other passes measure otherwise.
        metrics, redone = evaluate_fp16_safe(self.model, self.dev_data,
                                             ps.validate_batches_per_epoch * ps.batch_size,
                                             self.cfg.gpu_setting.pass_rows, ps.seed,
                                             ps.mask_prob, rt.device, rt.autocast_dtype, rt.rank, rt.world_size)
        note += " (in fp32: fp16 overflowed)" if redone else ""
        if not math.isfinite(metrics["loss"]):  # the weights of `step` diverged
            raise TrainingDiverged(_diverged_message(f"the dev loss is {metrics['loss']} after step {step}", step,
                                                     self.ckpt_dir, ps.batches_per_epoch))
        self.log.write(type="dev", epoch=epoch, step=step, **metrics,
                       **({"precision": "fp32 (fp16 overflowed)"} if redone else {}))  # as validate logs it
        self.say(f"epoch {epoch}: dev loss {metrics['loss']:.4f}, dev MLM accuracy {metrics['mlm_accu']:.4f}"
                 f"{accuracy_note(metrics)}{note}")

    def _attention_note(self) -> str:
        if self.cfg.model.attn_type != "nystrom":
            return ""
        from .attention.nystrom_fast import describe_switches
        return "; " + describe_switches(self.rt.device)

    # ------------------------------------------------------------------------------------------- the epochs
    def train(self, stop_at_step: Optional[int]) -> int:
        """Train to the end (exit status 0), or until a signal or ``stop_at_step`` stops the run after writing a
        checkpoint (130 or 143)."""
        rt = self.rt
        self._prepare_model()
        parameters = sum(p.numel() for p in self.model.parameters())
        recipe = self.cfg.gpu_setting.inst_per_gpu
        groups = f" (micro-batches of {recipe} each)" if self.micro > recipe else ""
        self.say(f"pretraining {self.cfg.model.attn_type} model: {parameters:,} parameters, "
                 f"{len(self.train_data):,} training sequences of {self.train_data.seq_len} tokens, "
                 f"{rt.world_size} process(es) on {rt.device.type}, passes of {self.micro} rows{groups} x "
                 f"{-(-self.per_rank // self.micro)} a step, precision "
                 f"{rt.autocast_dtype or torch.float32}{self._attention_note()}")
        self.model.train()
        while self.step < self.total_steps:
            epoch = self.step // self.ps.batches_per_epoch
            stopped = self._train_epoch(epoch, stop_at_step)
            if stopped is None:
                stopped = self._end_epoch(epoch, stop_at_step)
            if stopped is not None:
                return stopped
        self.say(f"pretraining finished: {self.step} steps; checkpoints in {self.ckpt_dir}")
        barrier(rt)  # every rank past its last collective before any of them tears the process group down
        return 0

    def _train_epoch(self, epoch: int, stop_at_step: Optional[int]) -> Optional[int]:
        """The rest of epoch ``epoch``'s steps. Returns None at the epoch's end, or the exit status after a stop
        within the epoch (a preemption checkpoint written)."""
        ps, rt = self.ps, self.rt
        bar = tqdm(total=ps.batches_per_epoch, initial=self.step % ps.batches_per_epoch, desc=f"epoch {epoch}",
                   disable=not (rt.is_main and self.show_progress), mininterval=1.0, dynamic_ncols=True)
        queued: Optional[QueuedStep] = None
        with contextlib.closing(bar):
            while True:
                # The device runs one step ahead of the host: step s + 1 is queued before step s's loss is read
                # back, so the host prepares and launches the next batch while the device is still busy, instead
                # of idling it at a sync every step.
                current = self.queue_step()
                signum = self.report(queued, bar, current.started) if queued is not None else 0
                queued = current
                stopping = signum or (stop_at_step is not None and self.step >= stop_at_step)
                if stopping or self.step % ps.batches_per_epoch == 0:
                    # every step's loss is checked before a checkpoint
                    signum = max(signum, self.report(queued, bar))
                    queued = None
                if self.step % ps.batches_per_epoch == 0:
                    return None  # the epoch's end decides on stopping, with its checkpoint
                if stopping:
                    break
        if rt.is_main:
            path = checkpoint.save_preempted(self.ckpt_dir, self.state_dict())
            self.log.write(type="preempted", step=self.step, checkpoint=str(path))
            self.say(f"stopped at step {self.step}; wrote {path}. Run the same command again to resume.")
        barrier(rt)
        return _stopped_exit_code(signum)

    def _end_epoch(self, epoch: int, stop_at_step: Optional[int]) -> Optional[int]:
        """Checkpoint the finished epoch, evaluate it on the dev split, and decide whether to stop: returns the
        exit status if so, else None."""
        rt, step = self.rt, self.step
        # Checkpoint first: a preemption's grace period (10 s for `docker stop`) may not cover the dev pass.
        if rt.is_main:
            checkpoint.save_epoch(self.ckpt_dir, epoch, self.state_dict(), keep=self.ps.keep_resume_checkpoints)
        barrier(rt)
        signum = self.preemption.agreed(rt)
        stopping = signum or (stop_at_step is not None and step >= stop_at_step)
        if self.dev_data is not None and not signum:
            self.evaluate_dev(epoch)
        has_dev = self.dev_data is not None
        if stopping and step < self.total_steps:
            skipped = " (dev evaluation skipped: the rerun does it first)" if signum and has_dev else ""
            self.say(f"stopped after epoch {epoch}{skipped}; run the same command again to resume.")
        elif signum:  # stopped by a signal at the very end: the rerun only does the dev evaluation
            self.say(f"stopped after the last epoch{' before its dev evaluation' if has_dev else ''}; run the same "
                     f"command again to finish.")
        else:
            return None
        barrier(rt)
        return _stopped_exit_code(signum)


class NonFiniteLosses:
    """When a non-finite training loss means the run diverged. Without loss scaling (bf16, fp32) the first one
    does: the optimizer step has already written NaN or inf into the weights. With fp16's GradScaler the step was
    skipped, the weights are unchanged and the next batch may be fine: only MAX_CONSECUTIVE_SKIPPED_STEPS in a row
    are a divergence. (Not "until the scale falls to 1": a non-finite loss comes from the forward pass, which the
    scale does not touch.)"""

    def __init__(self, scaled: bool, ckpt_dir, batches_per_epoch: int):
        self.scaled, self.ckpt_dir, self.batches_per_epoch = scaled, ckpt_dir, batches_per_epoch
        self.consecutive = 0

    def check(self, loss: float, step: int) -> bool:
        """Whether step ``step`` (counted from 1) was skipped; raises TrainingDiverged on a divergence."""
        if math.isfinite(loss):
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.scaled and self.consecutive < MAX_CONSECUTIVE_SKIPPED_STEPS:
            return True
        # The weights after step `first - 1` are the first to give a non-finite loss (skipped steps change none).
        first = step - self.consecutive + 1
        what = (f"the training loss is {loss} at step {step}" if self.consecutive == 1 else
                f"the training loss is not finite at {self.consecutive} steps in a row ({first} to {step}; the "
                f"GradScaler skipped them)")
        raise TrainingDiverged(_diverged_message(what, first - 1, self.ckpt_dir, self.batches_per_epoch))


def _stopped_exit_code(signum: int) -> int:
    """128 + the signal that stopped the run; --stop-at-step counts as a preemption (SIGTERM)."""
    return INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else PREEMPTED_EXIT_CODE


def _diverged_message(what: str, bad_step: int, ckpt_dir, batches_per_epoch: int) -> str:
    """``bad_step``: the first step whose weights gave a non-finite loss; checkpoints before it are good."""
    found = checkpoint.resumable_checkpoints(ckpt_dir, batches_per_epoch)
    good = [(s, p) for s, p in found if s < bad_step]
    bad = sorted(p.name for s, p in found if s >= bad_step)
    kept = (f"{good[0][1].name} (step {good[0][0]}) is the newest checkpoint from before the divergence" if good
            else "no checkpoint is from before the divergence")
    if bad:
        kept += f"; {', '.join(bad)} already hold(s) the diverged weights"
    return (f"training diverged: {what}; stopped, writing no further checkpoint: {kept}. Resuming would diverge "
            f"again: lower pretraining_setting.learning_rate (or set max_grad_norm) in a new model folder, with "
            f"\"from_cp\" pointing at a good checkpoint to keep its progress")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=".",
                        help="model folder holding config.json (default: current directory)")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda:LOCAL_RANK when available, else cpu)")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="stop after this global step as if preempted: writes a resumable checkpoint and exits "
                             "with status 143, as after SIGTERM (0 if the run ends first)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.model_dir)
        return pretrain(cfg, device=args.device, stop_at_step=args.stop_at_step, show_progress=not args.no_progress)
    finally:
        if dist.is_initialized():
            # DDP's reducer holds the process group: free it now (it may sit in a reference cycle) rather than at
            # interpreter exit, where gloo's worker threads tearing down aborted a rank now and then (SIGABRT,
            # "terminate called without an active exception", seen in CI's two-process test).
            gc.collect()
            dist.destroy_process_group()


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "pretrain", "MLM pretraining of a model folder (resumes automatically)", __doc__,
                   add_arguments, run)


def main(argv=None) -> int:
    return script_main("run_pretrain.py", __doc__, add_arguments, run, argv)
