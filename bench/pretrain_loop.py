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
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "code"))
sys.path.insert(0, str(REPO / "bench"))
from model_speed import batch, build, step_fn  # noqa: E402
from nystromformer import jsonlog, shards  # noqa: E402
from nystromformer.config import COMPILE_MODES, load_config  # noqa: E402
from nystromformer.pretrain import LOG_NAME, pretrain  # noqa: E402
from time_limit import STOPPED_STATUS, stop_on_sigterm, stopped_note  # noqa: E402

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


def loop_tokens_per_s(folder: Path, device: str, warmup: int) -> float:
    cfg = load_config(folder)
    status = pretrain(cfg, device=device, show_progress=False)
    if status != 0:  # pretrain's own SIGTERM/Ctrl-C handling finished its step and stopped: so does the table
        raise KeyboardInterrupt(f"pretrain stopped with status {status}")
    steps = [e for e in jsonlog.read(cfg.checkpoint_dir / LOG_NAME) if e.get("type") == "train"]
    return statistics.median(e["tokens_per_s"] for e in steps if e["step"] > warmup)


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


def validate_args(ap, args):
    """Checks between arguments (also what `DRY_RUN=1 bash bench/gpu_session.sh` checks before device time)."""
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
    rows, stopped = {}, None
    with tempfile.TemporaryDirectory(prefix="pretrain-loop-") as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        vocab = json.loads((REPO / "nystrom-512" / "config.json").read_text())["model"]["vocab_size"]
        args.steps += args.warmup  # the loop's epoch covers both
        write_random_shards(root / "data", args.seq_len, vocab, args.steps * args.batch)
        try:
            for name in MODELS:
                stopped = f"the {name} model's loop"
                folder = model_folder(root, name, args)
                loop = loop_tokens_per_s(folder, args.device, args.warmup)
                stopped = f"the {name} model's bare step"
                bare = bare_tokens_per_s(folder, device, args.warmup, args.steps - args.warmup, args.compile)
                rows[name] = loop, bare
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
    ratio = lambda a, b: "n/a" if b is None else f"{a / b:.2f}"  # noqa: E731
    for name, (loop, bare) in rows.items():
        print(f"| {name} | {loop:.0f} | {bare:.0f} | {loop / bare:.2f} | {ratio(loop, soft_loop)} | "
              f"{ratio(bare, soft_bare)} |")
    if stopped:
        print(stopped_note(stopped))
        sys.exit(STOPPED_STATUS)


if __name__ == "__main__":
    main()
