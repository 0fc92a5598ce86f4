"""Whole-model MLM training step: tokens/s and peak memory, nystrom vs softmax vs transformers' Nyströmformer.

One training step = forward (MLM loss on the ~15% masked positions) + backward + fused AdamW step, bf16 autocast
on CUDA, unpadded full-length batches of random tokens. Models (same size, ModelConfig defaults unless given):

  nystrom               our model, attn_type nystrom (conv --conv, 64 landmarks), attention_fp32 as --attention-fp32
  nystrom-all           the same with NYSTROM_TRITON=all (attention-pass kernels, one-node backward)
  nystrom-reference     the same with NYSTROM_IMPL=reference (the authors' formulation), for comparison
  nystrom[-all]-overlap the same with NYSTROM_OVERLAP=1 (kernel_2 and the pseudo-inverse on a second CUDA stream)
  nystrom-all-recompute nystrom-all with NYSTROM_RECOMPUTE=1 (the backward recomputes the landmark-sized tensors)
  softmax               our model, attn_type softmax (SDPA)
  hf-nystromformer      transformers.NystromformerForMaskedLM built by nystromformer.interop (when importable)
  hf-roberta            transformers.RobertaForMaskedLM with SDPA, same size: the softmax baseline issue #6 quotes
                        (its LM head runs over every position, ours over the masked ones only)
  attention-free        our model with the attention core replaced by "return V": not a model, the ceiling — the
                        step time of everything but attention, which no attention variant can beat (Amdahl)

Batches have no padding, so — as pretraining does since the mask-free path — no attention mask is passed
(attention_mask=None: no mask multiplies, SDPA free to use FlashAttention); ``--padding-mask`` passes an all-ones
mask instead, the setting of the first H100 figures in docs/performance.md.

Prints one Markdown table (tokens/s, ratios to softmax, to transformers' Nyströmformer and Roberta, peak MiB, the
median step's wall time, one step's device time — kernels summed by torch.profiler: well under the step time
means host-bound — and the host's time to issue the step's forward, backward and optimizer step, medians, with no
sync between them: when their sum is close to the step time, the host is what the device waits for).
``--host-profile MODEL`` also prints cProfile's table of one step of that model (Python functions by their own
host time: Triton's launcher, autograd, our wrappers), to find where a host-bound step's time goes.

    python bench/model_speed.py --seq-len 512 --batch 32
    python bench/model_speed.py --seq-len 4096 --batch 4 --models nystrom softmax
    python bench/model_speed.py --attention-fp32 false --compile reduce-overhead   # CUDA graphs
    python bench/model_speed.py --attention-fp32 true --models nystrom nystrom-all --host-profile nystrom-all
    python bench/model_speed.py --device cpu --seq-len 128 --batch 2 --layers 2 --steps 2   # smoke test
    TRITON_INTERPRET=1 NYSTROM_IMPL=fast python bench/model_speed.py --device cpu --seq-len 128 --batch 1 \
        --layers 2 --steps 1 --warmup 1 --models nystrom-all --host-profile nystrom-all \
        --host-profile-only nystromformer/attention   # our wrappers' own host time, on the CPU
"""
from __future__ import annotations

import argparse
import cProfile
import csv
import io
import os
import pstats
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
from nystromformer.config import COMPILE_MODES, ModelConfig  # noqa: E402
from nystromformer.model import NystromformerForMaskedLM, masked_positions_of  # noqa: E402

from compile_first import print_commands, run_untimed, workers_for  # noqa: E402
from time_limit import failure, finish, stop_on_sigterm  # noqa: E402

MODELS = ["nystrom", "nystrom-all", "nystrom-reference", "softmax", "hf-nystromformer", "hf-roberta", "attention-free",
          "nystrom-overlap", "nystrom-all-overlap", "nystrom-all-recompute"]
# The switches each of our Nyström variants runs under (set for its build and steps over the caller's own, e.g.
# NYSTROM_IMPL=fast for the CUDA path's code on CPU; restored after)
ENV = {"nystrom-all": {"NYSTROM_TRITON": "all"}, "nystrom-reference": {"NYSTROM_IMPL": "reference"},
       "nystrom-overlap": {"NYSTROM_OVERLAP": "1"}, "nystrom-all-overlap": {"NYSTROM_TRITON": "all",
                                                                          "NYSTROM_OVERLAP": "1"},
       "nystrom-all-recompute": {"NYSTROM_TRITON": "all", "NYSTROM_RECOMPUTE": "1"}}
SWITCHES = ("NYSTROM_IMPL", "NYSTROM_TRITON", "NYSTROM_OVERLAP", "NYSTROM_RECOMPUTE")
HF_MODELS = ("hf-nystromformer", "hf-roberta")


class _ValuesOnly(torch.nn.Module):
    """The attention-free ceiling: the attention core returns V (projections, FFN, head and optimizer unchanged)."""

    def forward(self, q, k, v, mask):
        return v


def build(name, cfg, device):
    if name == "hf-nystromformer":
        from nystromformer.interop import build_hf_model
        ours = NystromformerForMaskedLM(cfg)
        model = build_hf_model(cfg, ours.state_dict()).train()
        return model.to(device), True
    if name == "hf-roberta":
        import transformers
        rc = transformers.RobertaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.transformer_dim, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_head, intermediate_size=cfg.transformer_hidden_dim,
            max_position_embeddings=cfg.max_seq_len + 2, type_vocab_size=cfg.num_sen_type,
            layer_norm_eps=cfg.layer_norm_eps, pad_token_id=cfg.pad_token_id, attn_implementation="sdpa")
        return transformers.RobertaForMaskedLM(rc).to(device).train(), True
    c = replace(cfg, attn_type="softmax") if name in ("softmax", "attention-free") else cfg
    model = NystromformerForMaskedLM(c)
    if name == "attention-free":
        for layer in model.encoder.layers:
            layer.attention.attn = _ValuesOnly()
    return model.to(device).train(), False


def batch(cfg, b, n, device, seed=0, padding_mask=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (b, n), generator=g)
    labels = torch.full_like(ids, -100)
    sel = torch.rand(b, n, generator=g) < 0.15
    labels[sel] = ids[sel]
    mask = torch.ones(b, n, dtype=torch.long, device=device) if padding_mask else None
    # Found on the host, as pretraining does: no device sync for the masked positions' data-dependent count.
    return ids.to(device), labels.to(device), mask, masked_positions_of(labels).to(device)


def step_fn(model, is_hf, opt, device, amp, host_times=None):
    """One training step; with ``host_times`` (a list) it appends the host's seconds to issue the forward, the
    backward and the optimizer step (no sync between them: on CUDA, the time to queue the work, not to run it)."""
    def step(ids, labels, mask, positions):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            if is_hf:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            else:
                loss = model(ids, labels, mask, masked_positions=positions).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if host_times is not None:
            host_times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return loss
    return step


def host_profile(step, batch_data, device, rows=30, only=None):
    """cProfile's table of one step: Python functions by their own host time (tottime), with call counts. The
    backward runs on the calling thread for it (on CUDA autograd runs it on a thread of its own, out of cProfile's
    sight): the Python of custom backward functions and the launches they make are in the table."""
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        step(*batch_data)
        profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    # ``only``: a regular expression on "file:line(function)", applied before the row limit
    stats.print_stats(*([only] if only else []), rows)
    # From the header ("ncalls tottime ...") on: the run's own totals line is kept above it
    lines = text.getvalue().splitlines()
    total = next((line.strip() for line in lines if "function calls" in line), "")
    if only:  # the table rounds to ms; the matched functions' own time summed, finer
        matched = [tt for (file, line, name), (_, _, tt, _, _) in stats.stats.items()
                   if re.search(only, f"{file}:{line}({name})")]
        total += f"; own time of the {len(matched)} functions matching {only!r}: {sum(matched) * 1e3:.3f} ms"
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join([total, *lines[start:]]).rstrip()


def device_ms(step, batch_data, device):
    """Milliseconds of device work in one step: the durations of its CUDA kernels, copies and memsets summed
    (torch.profiler). Against the step's wall time it tells a host-bound step (device idle between launches)
    from a device-bound one; above the wall time, kernels overlapped (streams). None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(*batch_data)
        torch.cuda.synchronize()
    return sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA") / 1e3


def kernel_breakdown(step, batch_data, device, rows=25):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step(*batch_data)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


def untimed_argv(args, name: str) -> list[str]:
    """This script for one model at one layer, one step, untimed and uncompiled (torch.compile's own kernels are
    not ours): its layer launches what each layer of the table's model does, so it compiles their kernels."""
    padding = ["--padding-mask"] if args.padding_mask else []
    return [sys.executable, __file__, "--device", args.device, "--models", name, "--seq-len", str(args.seq_len),
            "--batch", str(args.batch), "--layers", "1", "--attention-fp32", args.attention_fp32,
            "--conv", str(args.conv), "--warmup", "1",
            "--steps", "1", "--compile-workers", "0", *padding]


def validate_args(ap, args):
    """Checks between arguments (also what `DRY_RUN=1 bash bench/gpu_session.sh` checks before device time)."""
    for name in args.kernels + args.host_profile:
        if name not in args.models:
            ap.error(f"{name} is not among --models ({' '.join(args.models)})")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--attention-fp32", default="true", choices=["true", "false"])
    ap.add_argument("--conv", type=int, default=33,
                    help="the depthwise conv's kernel size (default 33, the paper's and the issue's; the shipped "
                         "nystrom-512 and nystrom-4096 folders have 65, as the authors' released checkpoints)")
    ap.add_argument("--compile", default="none", choices=COMPILE_MODES,
                    help="torch.compile our models' encoders in this mode, as gpu_setting.compile does in "
                         "pretraining (reduce-overhead = CUDA graphs)")
    ap.add_argument("--padding-mask", action="store_true",
                    help="pass an all-ones attention mask (the first H100 run's setting) instead of None")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kernels", nargs="*", default=[], metavar="MODEL",
                    help="also print a per-kernel device-time breakdown (torch.profiler) of one step of these models")
    ap.add_argument("--host-profile", nargs="*", default=[], metavar="MODEL",
                    help="also print cProfile's table of one step of these models (host time by Python function)")
    ap.add_argument("--compile-workers", type=int, default=None, metavar="N",
                    help="first run each model of ours that launches Triton kernels (nystrom*, not -reference) for "
                         "one step of a one-layer model, untimed, in a process of its own, N at a time: every layer "
                         "launches the same kernels, which then load from Triton's cache instead of compiling one "
                         "at a time (default 8 on CUDA; 0 on the CPU: the interpreter compiles nothing)")
    ap.add_argument("--csv", metavar="FILE",
                    help="also write the table's rows to FILE (one row a model, with the run's settings and device; "
                         "what bench/targets_report.py reads)")
    ap.add_argument("--print-untimed", action="store_true",
                    help="print the untimed compile pass's commands (JSON, one a line) and stop: "
                         "`compile_first.py` runs several benchmarks' in one pool (gpu_session.sh's targets stage)")
    ap.add_argument("--host-profile-only", default=None, metavar="REGEX",
                    help="only the profile's rows whose file:line(function) matches, e.g. nystromformer/ for our "
                         "own code (on the CPU under TRITON_INTERPRET=1 the interpreter's rows hide it)")
    return ap


def measure(name: str, args, cfg: ModelConfig, device: torch.device, amp: bool):
    """(tokens/s, peak MiB, step ms, device ms, host ms fwd/bwd/opt) of one model's training step, its kernel
    breakdown and host profile (None unless asked for); None when the model cannot be built here."""
    try:
        torch.manual_seed(0)
        model, is_hf = build(name, cfg, device)
    except Exception as exc:  # transformers missing or incompatible
        print(f"# {name}: skipped ({type(exc).__name__}: {exc})")
        return None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if args.compile != "none" and not is_hf:
        model.encoder.compile(mode=args.compile)
    host_times = []
    step = step_fn(model, is_hf, opt, device, amp, host_times)
    data = [batch(cfg, args.batch, args.seq_len, device, seed=i, padding_mask=args.padding_mask) for i in range(2)]
    # compiled: the first calls compile, record and warm up the CUDA graphs
    for i in range(args.warmup if args.compile == "none" else max(args.warmup, 5)):
        step(*data[i % 2])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    del host_times[:]
    for i in range(args.steps):
        t = time.perf_counter()
        step(*data[i % 2])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    host = [statistics.median(part) * 1e3 for part in zip(*host_times)]
    row = (args.batch * args.seq_len / statistics.median(times), peak, statistics.median(times) * 1e3,
           device_ms(step, data[0], device), host)
    breakdown = kernel_breakdown(step, data[0], device) if name in args.kernels else None
    profile = host_profile(step, data[0], device, only=args.host_profile_only) if name in args.host_profile else None
    return row, breakdown, profile


def write_csv(args, dev: str, rows: dict, soft, hf) -> None:
    """The table's rows with the run's settings, written whole (a stopped run writes the rows it measured)."""
    fields = ["model", "seq_len", "batch", "layers", "conv", "attention_fp32", "compile", "device", "tokens_per_s",
              "vs_softmax", "vs_hf_nystromformer", "peak_mib", "step_ms", "device_ms"]
    tmp = Path(args.csv).with_name(Path(args.csv).name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for name, (tps, peak, step_ms, dev_ms, _host) in rows.items():
            w.writerow(dict(model=name, seq_len=args.seq_len, batch=args.batch, layers=args.layers, conv=args.conv,
                            attention_fp32=args.attention_fp32, compile=args.compile, device=dev,
                            tokens_per_s=tps, vs_softmax=tps / soft if tps and soft else None,
                            vs_hf_nystromformer=tps / hf if tps and hf else None, peak_mib=peak, step_ms=step_ms,
                            device_ms=dev_ms))
    os.replace(tmp, args.csv)


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    validate_args(ap, args)
    stop_on_sigterm()
    device = torch.device(args.device)
    workers = workers_for(args.compile_workers, device.type)
    compiled = [name for name in args.models if name.startswith("nystrom") and name != "nystrom-reference"]
    untimed = [untimed_argv(args, name) for name in compiled]
    if args.print_untimed:
        print_commands(untimed)
        return
    if workers > 0 and compiled:
        print(run_untimed(untimed, dict(os.environ), workers), flush=True)
    amp = device.type == "cuda"
    cfg = ModelConfig(max_seq_len=args.seq_len, num_layers=args.layers, conv_kernel_size=args.conv,
                      attention_fp32=args.attention_fp32 == "true")
    rows, breakdowns, profiles = {}, {}, {}
    caller = {key: os.environ[key] for key in SWITCHES if key in os.environ}  # the caller's, under every row's own
    failures, stopped = [], None
    try:
        for name in args.models:
            stopped = f"the {name} model"
            for key in SWITCHES:
                os.environ.pop(key, None)
            os.environ.update(caller)
            os.environ.update(ENV.get(name, {}))
            try:
                measured = measure(name, args, cfg, device, amp)
            except torch.OutOfMemoryError:
                measured = (None, None, None, None, None), None, None
            except Exception as error:  # noqa: BLE001 — named under the table; the other models still measured
                failures.append(failure(name, error))
                measured = (None, None, None, None, None), None, None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if measured is None:
                continue
            rows[name], breakdown, profile = measured
            if breakdown is not None:
                breakdowns[name] = breakdown
            if profile is not None:
                profiles[name] = profile
        stopped = None
    except KeyboardInterrupt:
        pass  # stopped names the model under way
    finally:
        for key in SWITCHES:
            os.environ.pop(key, None)
        os.environ.update(caller)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# MLM train step, n={args.seq_len}, batch={args.batch}, layers={args.layers}, conv={args.conv}, "
          f"attention_fp32={args.attention_fp32}, compile={args.compile}, padding_mask={args.padding_mask}, "
          f"device={dev}, torch {torch.__version__}")
    fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    ratio = lambda a, b: fmt(a / b if a and b else None, ".2f")  # noqa: E731
    soft, hf, roberta = (rows.get(name, (None,))[0] for name in ("softmax", "hf-nystromformer", "hf-roberta"))
    print("| model | tokens/s | × softmax | × transformers Nyströmformer | × transformers Roberta | peak MiB | "
          "step ms | device ms | host ms fwd / bwd / opt |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (tps, peak, step_ms, dev_ms, host) in rows.items():
        host_ms = "n/a" if host is None else " / ".join(format(x, ".1f") for x in host)
        print(f"| {name} | {fmt(tps, '.0f')} | {ratio(tps, soft)} | {ratio(tps, hf)} | {ratio(tps, roberta)} | "
              f"{fmt(peak, '.0f')} | {fmt(step_ms, '.1f')} | {fmt(dev_ms, '.1f')} | {host_ms} |")
    if args.csv and rows:
        write_csv(args, dev, rows, soft, hf)
    for name, table in breakdowns.items():
        print(f"\n# kernels of one {name} training step (self device time)\n{table}")
    for name, table in profiles.items():
        print(f"\n# host time of one {name} training step by Python function (cProfile, tottime)\n{table}")
    finish(failures, stopped)


if __name__ == "__main__":
    main()
