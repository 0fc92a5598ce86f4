"""The product's pretraining loop against the bare training step. Issue #6's training targets are about
`nystromformer pretrain`; bench/model_speed.py times a bare step (forward, backward, fused AdamW). This script
runs both, in one process, for our nystrom and softmax models:

  loop   `pretrain` itself, on random-token shards written to a temporary folder: tokens/s from its JSON log,
         the median over the steps after --warmup (a logged step's time is the interval between two reads of the
         loss, i.e. throughput: the device runs one step ahead of the host)
  bare   model_speed's step on the same model settings and batch, timed with a device sync per step

and prints one table: tokens/s of both, loop ÷ bare (what the loop's data preparation, masking, logging and
host-device syncs cost) and nystrom ÷ softmax for each. Model settings: nystrom-512/config.json's (conv 65,
64 landmarks, bf16 autocast on a GPU with bf16) with the sizes and --attention-fp32 given here.

    python bench/pretrain_loop.py                                        # GPU: n 512, batch 32, 30 steps
    python bench/pretrain_loop.py --seq-len 4096 --batch 4
    python bench/pretrain_loop.py --compile reduce-overhead              # both with CUDA graphs
    python bench/pretrain_loop.py --micro-batch 8 --attention-fp32 true  # the shipped micro-batch and attention
    python bench/pretrain_loop.py --micro-batch 8 --rows-per-pass 32 --attention-fp32 true  # the same, one pass
    python bench/pretrain_loop.py --device cpu --seq-len 64 --batch 2 --layers 2 --steps 4 --warmup 1  # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "code"))
sys.path.insert(0, str(REPO / "bench"))
from model_speed import batch, build, step_fn  # noqa: E402
from nystromformer import jsonlog, shards  # noqa: E402
from nystromformer.config import COMPILE_MODES, load_config  # noqa: E402
from nystromformer.pretrain import LOG_NAME, pretrain  # noqa: E402
from time_limit import failure, finish, stop_on_sigterm  # noqa: E402

SPECIAL = {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": 50264}  # RoBERTa's ids
MODELS = ("nystrom", "softmax")


def write_random_shards(folder: Path, seq_len: int, vocab_size: int, count: int) -> None:
    rng = np.random.default_rng(0)
    meta = shards.make_meta(seq_len, vocab_size, "random tokens (bench/pretrain_loop.py)", SPECIAL)
    shards.write_meta(folder, meta)
    body = rng.integers(5, vocab_size - 1, size=(count, seq_len - 2))
    rows = np.concatenate([np.full((count, 1), SPECIAL["bos"]), body, np.full((count, 1), SPECIAL["eos"])], axis=1)
    shards.write_shard(folder / "train-00000.npy", rows, meta)
    shards.write_split_index(folder, "train", ["train-00000.npy"])


def model_folder(root: Path, attn_type: str, args) -> Path:
    config = json.loads((REPO / "nystrom-512" / "config.json").read_text())
    config["model"].update(attn_type=attn_type, max_seq_len=args.seq_len, num_layers=args.layers,
                           attention_fp32=args.attention_fp32 == "true")
    config["pretraining_setting"].update(batch_size=args.batch, epoch=1, batches_per_epoch=args.steps,
                                         validate_batches_per_epoch=0, batches_per_report=1)
    config["gpu_setting"] = {"inst_per_gpu": args.micro_batch or args.batch, "rows_per_pass": args.rows_per_pass,
                             "compile": args.compile}
    config.update(model_checkpoints="model", data_folder=str(root / "data"))
    folder = root / attn_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def loop_tokens_per_s(folder: Path, device: str, warmup: int, steps: int) -> tuple[Optional[float], int]:
    """The loop's tokens/s (median over the logged steps after ``warmup``; None unless all ``steps`` were logged)
    and pretrain's status (non-zero: its SIGTERM/Ctrl-C handling stopped it — maybe only while it wrote the
    epoch's checkpoint, after every step was logged: the figure is kept then)."""
    cfg = load_config(folder)
    status = pretrain(cfg, device=device, show_progress=False)
    log = cfg.checkpoint_dir / LOG_NAME
    logged = [e for e in jsonlog.read(log) if e.get("type") == "train"] if log.exists() else []
    timed = [e["tokens_per_s"] for e in logged if e["step"] > warmup]
    return (statistics.median(timed) if len(timed) == steps - warmup else None), status


def bare_tokens_per_s(folder: Path, device: torch.device, warmup: int, steps: int, compile_mode: str) -> float:
    cfg = load_config(folder)
    torch.manual_seed(0)
    model, _ = build(cfg.model.attn_type, cfg.model, device)
    if compile_mode != "none":
        model.encoder.compile(mode=compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step = step_fn(model, False, opt, device, amp=device.type == "cuda" and cfg.model.mixed_precision)
    data = [batch(cfg.model, cfg.pretraining_setting.batch_size, cfg.model.max_seq_len, device, seed=i)
            for i in range(2)]
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        step(*data[i % 2])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return cfg.pretraining_setting.batch_size * cfg.model.max_seq_len / statistics.median(times[warmup:])


def scratch_dir(need: int = 8 << 30) -> Optional[str]:
    """/dev/shm (memory) where it is writable with ``need`` bytes free, else None (the system's temporary folder):
    each run's `pretrain` writes and fsyncs its end-of-epoch checkpoint (1.85 GiB at 12 layers, ~5.5 s to disk on
    the CPU machine), device time the timed steps do not include but the stage spends. One model's folder at a
    time: each is removed once its row is measured."""
    shm = Path("/dev/shm")
    try:
        return str(shm) if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need else None
    except OSError:
        return None


def validate_args(ap, args):
    """Checks between arguments (also what `DRY_RUN=1 bash bench/gpu_session.sh` checks before device time)."""
    for flag, value, low in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--batch", args.batch, 1),
                             ("--seq-len", args.seq_len, 8), ("--layers", args.layers, 1),
                             ("--micro-batch", args.micro_batch, 1), ("--rows-per-pass", args.rows_per_pass, 1)):
        if value is not None and value < low:
            ap.error(f"{flag}: must be at least {low}, got {value}")
    for flag, value in (("--micro-batch", args.micro_batch), ("--rows-per-pass", args.rows_per_pass)):
        if value is not None and value > args.batch:  # pretrain would clamp it to the batch: the title would lie
            ap.error(f"{flag} {value} is above --batch {args.batch} (a step's rows)")
    if args.micro_batch and args.batch % args.micro_batch:
        ap.error(f"--batch {args.batch} must be a multiple of --micro-batch {args.micro_batch}")
    if args.rows_per_pass and args.rows_per_pass % (args.micro_batch or args.batch):
        ap.error(f"--rows-per-pass {args.rows_per_pass} must be a multiple of --micro-batch "
                 f"({args.micro_batch or args.batch}: the default is --batch)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after --warmup) of each")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", default="none", choices=COMPILE_MODES)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="the loop's inst_per_gpu (default --batch: one micro-batch a step; the shipped folders' 8 "
                         "makes a step of 32 rows 4 micro-batches); the bare step is always one micro-batch")
    ap.add_argument("--rows-per-pass", type=int, default=None,
                    help="the loop's rows_per_pass (default: --micro-batch): several micro-batches to a pass, the "
                         "Nyström init still over each micro-batch")
    ap.add_argument("--attention-fp32", default="false", choices=["true", "false"],
                    help="model.attention_fp32 (false: attention in bf16, as model_speed's main rows and the "
                         "issue's SDPA baseline; nystrom-512/config.json has true)")
    args = ap.parse_args(argv)
    validate_args(ap, args)
    stop_on_sigterm()
    device = torch.device(args.device)
    if args.compile != "none" and args.warmup < 5:  # as model_speed: compiling and graph recording take steps
        print(f"# --warmup {args.warmup} raised to 5 under --compile {args.compile} (recording steps untimed)")
        args.warmup = 5
    rows, failures, stopped = {}, [], None
    with tempfile.TemporaryDirectory(prefix="pretrain-loop-", dir=scratch_dir()) as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        vocab = json.loads((REPO / "nystrom-512" / "config.json").read_text())["model"]["vocab_size"]
        args.steps += args.warmup  # the loop's epoch covers both
        write_random_shards(root / "data", args.seq_len, vocab, args.steps * args.batch)
        try:
            for name in MODELS:
                stopped = f"the {name} model's loop"
                try:
                    folder = model_folder(root, name, args)
                    loop, status = loop_tokens_per_s(folder, args.device, args.warmup, args.steps)
                    if loop is not None:
                        rows[name] = (loop, None)  # kept if the bare step is stopped or fails
                    if status != 0:  # pretrain's SIGTERM/Ctrl-C handling stopped it: so does the table
                        raise KeyboardInterrupt(f"pretrain stopped with status {status}")
                    stopped = f"the {name} model's bare step"
                    rows[name] = (loop, bare_tokens_per_s(folder, device, args.warmup, args.steps - args.warmup,
                                                          args.compile))
                except Exception as error:  # one model failing (e.g. out of memory) keeps the other's row
                    failures.append(failure(stopped, error))
                    rows.setdefault(name, (None, None))
                finally:  # its checkpoints (GiBs, in memory on /dev/shm) gone before the next model's
                    shutil.rmtree(root / name, ignore_errors=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            stopped = None
        except KeyboardInterrupt:
            pass  # stopped names the run under way

    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    passes = f", passes of {args.rows_per_pass}" if args.rows_per_pass else ""
    print(f"# pretraining loop vs bare step, n={args.seq_len}, batch={args.batch} (loop: micro-batches of "
          f"{args.micro_batch or args.batch}{passes}), layers={args.layers}, "
          f"compile={args.compile}, attention_fp32={args.attention_fp32}, {args.steps - args.warmup} timed steps, "
          f"device={dev}, torch {torch.__version__}")
    print("| model | loop tokens/s | bare tokens/s | loop ÷ bare | loop × softmax | bare × softmax |")
    print("|---|---|---|---|---|---|")
    soft_loop, soft_bare = rows.get("softmax", (None, None))
    ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
    figure = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
    for name, (loop, bare) in rows.items():
        print(f"| {name} | {figure(loop)} | {figure(bare)} | {ratio(loop, bare)} | {ratio(loop, soft_loop)} | "
              f"{ratio(bare, soft_bare)} |")
    finish(failures, stopped)


if __name__ == "__main__":
    main()
