"""Launch settings of the one-node layer's n-long kernels, swept: each wrapper timed alone at its chosen settings
and at variations of them (rows a tile, tiles a program, warps, pipeline stages).

`bench/bytes_moved.py` found the layer moving ~1.9× the bandwidth floor's bytes at long n while the H100 timed it at
7.1× the floor: its kernels run at ~28% of the copy bandwidth (docs/performance.md, "Bytes moved"). The chosen
settings came from ptxas's spills, never from a sweep. This times each wrapper of `nystrom_triton` that reads or
writes the n-long tensors — on the inputs the layer gives it (its own forward's landmark tensors) — under every
setting in `variations()`, through `nystrom_triton.LAUNCH_OVERRIDES`, and checks that every setting computes what
the chosen one does (relative difference of all outputs, by norm and elementwise, within the dtype's
`TOLERANCE`; settings only reorder sums).

    python bench/kernel_settings.py                           # GPU: n = 4096 and 65,536, 65,536 tokens, bf16
    python bench/kernel_settings.py --wrappers conv_backward_raw lk_backward_raw --lengths 65536
    python bench/kernel_settings.py --device cpu --tokens 256 --lengths 128 --heads 1 --head-dim 16 --landmarks 8 \\
        --conv 5 --dtype fp32                                 # CPU: Triton's interpreter, checks only

Each wrapper runs in a process of its own, for every length (each setting compiles once): on a GPU a setting
Triton compiles wrong can fault and take the CUDA context with it — that wrapper's rows say so, the others still
run. On CUDA every wrapper's process first runs once untimed, 8 at a time (`--compile-workers`,
bench/compile_first.py): the sweep is compile-bound, and the timed processes, one at a time, then load the
kernels from Triton's cache. One table, a wrapper's rows printed as its process ends (a run cut off keeps them):
wrapper, n, setting, what its first kernel was launched with (after the wrapper's clamps to n), programs
launched, median ms (CUDA events), × the chosen setting's time, relative difference of the outputs (norm;
largest element over the largest magnitude). A setting faster than the chosen one by more than the noise is a
candidate for the wrapper's default — after the GPU tests pass with it (`bash bench/gpu_session.sh check` with
the default changed).

`--best FILE` keeps what the file held for other dtypes and for wrappers not swept (or whose sweep failed), and
writes each entry with `"when"`: the wrapper's own settings at this sweep's shape, so that the layer applies it
only where the wrapper chooses the same (`conv_weight_grad_mm` chooses other tiles for fp32 at a conv above 64).
Sweep at the shape that will run (`--conv 65` for the shipped configs). A wrapper whose process failed makes the
exit status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compile_first import run_untimed, workers_for
from time_limit import STOPPED_STATUS, stop_on_sigterm, stopped_note

ROOT = Path(__file__).resolve().parents[1]
# What the first kernel of a wrapper's call was launched with: rows a tile (BLOCK_N, or BLOCK_K for pass 1's key
# blocks), tiles a program, warps, stages (absent: Triton's default)
LAUNCH_KEYWORDS = ("BLOCK_N", "BLOCK_K", "TILES", "ROWS", "PARTS", "num_warps", "num_stages")
WRAPPERS = ["segment_means_raw", "lq_forward_raw", "lq_combine", "lk_forward_raw", "lk_backward_raw",
            "lq_backward_raw", "segment_means_grad", "conv_backward_raw", "conv_raw", "conv_weight_grad_mm"]
# Settings asked of _launch by name inside another wrapper's call: that call is timed, and the launch reported is
# this kernel's (pass 1's combine launches only when pass 1 has several programs a (batch, head): n > 512 in bf16)
INSIDE = {"lq_combine": ("lq_forward_raw", "_lq_combine_kernel")}


def variations(chosen: dict, min_rows: int = 16) -> list[dict]:
    """The settings tried beside the chosen ones: each setting halved and doubled (rows ≥ ``min_rows``), warps
    4 ↔ 8, and 2 or 4 pipeline stages (Triton's default on Hopper, 3, is the chosen one's)."""
    out = [{}]
    for key in ("rows", "tiles", "parts"):
        if key in chosen:
            out += [{key: c} for c in (chosen[key] // 2, chosen[key] * 2) if c >= (min_rows if key == "rows" else 1)]
    out += [{"num_warps": 4 if chosen["num_warps"] == 8 else 8}]
    out += [{"num_stages": s} for s in (2, 4)]
    return out


# A setting computes what the chosen one does when its outputs' relative difference (norm of the difference over
# the norm) and largest elementwise difference (over the output's largest magnitude) are within these, for the
# inputs' dtype: sums in another order round differently, more in bf16 outputs; a setting that drops or misplaces
# rows moves a whole row by its own size, which the elementwise bound catches where the norm of 65,536 rows would not
TOLERANCE = {"bf16": (1e-2, 5e-2), "fp32": (1e-4, 1e-3), "fp64": (1e-10, 1e-9)}


def agrees(row: dict, dtype: str) -> bool:
    norm, elementwise = TOLERANCE[dtype]
    return "diff" in row and row["diff"] <= norm and row.get("max_diff", 0.0) <= elementwise


def setting_label(override: dict) -> str:
    return "chosen" if not override else ", ".join(f"{k}={v}" for k, v in override.items())


def layer_inputs(args, device):
    """Every wrapper's call on the tensors the one-node layer hands it: {wrapper: (prepare, run)}, where
    ``prepare()`` makes what one call changes in place (untimed) and ``run(prepared)`` is the timed call."""
    import torch

    from nystromformer.attention import nystrom_triton as nt
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    b, n, h, d, m = args.tokens // args.n, args.n, args.heads, args.head_dim, args.landmarks
    g = torch.Generator(device="cpu").manual_seed(0)

    def heads():  # (b, h, n, d) views of (b, n, h, d), as the model's
        return torch.randn(b, n, h, d, generator=g).to(device, dtype).transpose(1, 2)
    q, k, v, grad = heads(), heads(), heads(), heads()
    keep = torch.ones(b, n, device=device, dtype=dtype)
    taps = torch.randn(h, args.conv, generator=g).to(device) * 0.1
    _, q_land, k_land, w, lse, zw, stat, cols, zs = nt.layer_forward(q, k, v, keep, None, taps, m, 6,
                                                                     "tf32x3" if dtype != torch.float64 else "ieee")
    dq, dkl_pass2, dzw = nt.lk_backward_raw(q, keep, k_land, zw, grad, dzw_dtype=zw.dtype)
    dq_land, dk_land, dw = nt._core_reverse(q_land, k_land, w, stat, cols, zs, dzw, 6,
                                            "tf32x3" if dtype != torch.float64 else "ieee", has_w=True,
                                            group=b * h, land_dtype=stat.dtype, dw_dtype=dtype)
    fuse_k = k.element_size() <= nt.K_MEANS_GRAD_IN_PASS_1_MAX_BYTES
    nothing = lambda: None  # noqa: E731
    fresh_dv = lambda: v.clone()  # noqa: E731  (pass 1's dV, which the conv's input gradient is added into)
    return {
        "segment_means_raw": (nothing, lambda _: nt.segment_means_raw(q, keep, m, x2=k)),
        "lq_forward_raw": (nothing, lambda _: nt.lq_forward_raw(q_land, k, v, None, low=False)),
        "lk_forward_raw": (nothing, lambda _: nt.lk_forward_raw(q, keep, k_land, zw, v, taps)),
        "lk_backward_raw": (nothing, lambda _: nt.lk_backward_raw(q, keep, k_land, zw, grad, dzw_dtype=zw.dtype)),
        # dQ̃ summed over the programs (their partials differ with the programs; the layer sums them later)
        "lq_backward_raw": (nothing, lambda _: nt.lq_backward_raw(q_land, k, v, None, w, lse, dw,
                                                                  seg=(keep, dk_land, dkl_pass2) if fuse_k else None)),
        "segment_means_grad": (lambda: dq.clone(), lambda dq_: nt.segment_means_grad(
            dq_land, keep, n, add=dq_, mask_add=True, out=dq_, g2=dq_land)),
        "conv_backward_raw": (fresh_dv, lambda dv: (nt.conv_backward_raw(v, keep, grad, taps, dv), dv)),
        "conv_raw": (fresh_dv, lambda dv: nt.conv_raw(grad, keep, taps, dv, in_mask=False, out_mask=True, out=dv,
                                                      flip=True)),
        "conv_weight_grad_mm": (nothing, lambda _: nt.conv_weight_grad_mm(v, keep, grad, (h, 1, args.conv, 1))),
    }


def sweep(wrapper: str, args, n: int) -> list[dict]:
    """Rows for one wrapper at length n: setting, programs, ms, relative difference, or the error it raised."""
    import torch

    from nystromformer.attention import nystrom_fast
    from nystromformer.attention import nystrom_triton as nt
    device = torch.device(args.device)
    args.n = n
    caller, kernel = INSIDE.get(wrapper, (wrapper, None))
    prepare, run_once = layer_inputs(args, device)[caller]

    def fn():
        return run_once(prepare())
    programs, launched = [0], []  # programs of the call's launches; the first launch's settings
    if device.type == "cuda":
        from triton.runtime.jit import JITFunction as Launched
    else:
        from triton.runtime.interpreter import InterpretedFunction as Launched
    launch_run = Launched.run

    def counted(self, *a, **kw):
        grid = kw.get("grid")
        grid = grid(kw) if callable(grid) else grid
        count = 1
        for size in grid:
            count *= size
        programs[0] += count
        if not launched and kernel in (None, self.fn.__name__):
            launched.append({k: kw[k] for k in LAUNCH_KEYWORDS if k in kw})
        return launch_run(self, *a, **kw)
    Launched.run = counted

    # the chosen settings: what the wrapper asks _launch for on this call
    seen, launch = {}, nt._launch
    nt._launch = lambda name, dtype, **chosen: (seen.setdefault(name, chosen), launch(name, dtype, **chosen))[1]
    reference = fn()
    nt._launch = launch
    chosen = seen.get(wrapper)
    if chosen is None and wrapper in INSIDE:
        Launched.run = launch_run
        return [{"setting": "chosen", "error": f"not launched by {caller} at n = {n}"}]
    if chosen is None:
        raise SystemExit(f"{wrapper} asked nystrom_triton._launch for no settings (renamed?)")
    reference = [t.detach().double().clone() for t in flat(reference)]
    own = {k: v for k, v in chosen.items() if k in nystrom_fast.LAUNCH_SETTINGS.get(wrapper, ())}
    rows = []
    for override in variations(chosen, nystrom_fast.MIN_ROWS.get(wrapper, 16)):
        nt.LAUNCH_OVERRIDES.clear()
        if override:
            nt.LAUNCH_OVERRIDES[wrapper] = override
        row = {"setting": setting_label(override), "override": override, **({} if override else {"own": own})}
        try:
            out = [t.detach().double() for t in flat(fn())]  # compiles this setting; its result is checked
            row["diff"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(out, reference))
            row["max_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                  for a, b in zip(out, reference))
            programs[0] = 0
            launched.clear()
            fn()
            row["programs"], row["launched"] = programs[0], launched[0]
            row["ms"] = time_it(prepare, run_once, device, args.repeat)
        except Exception as exc:  # a refused or failing setting is a row, not the end of the sweep
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            if device.type == "cuda" and "illegal" in str(exc).lower():
                rows.append(row)
                break  # the CUDA context is gone
        rows.append(row)
    nt.LAUNCH_OVERRIDES.clear()
    Launched.run = launch_run
    return rows


def child_sweep(args) -> dict:
    """{n: rows} of one wrapper at every length; a length whose sweep raised gets one row naming the error, and
    after a CUDA fault (the context is gone: every later launch would fail) the longer lengths are not tried."""
    out = {}
    for n in args.lengths:
        try:
            out[n] = sweep(args.child, args, n)
        except Exception as exc:  # e.g. the chosen setting's reference call itself failed
            first = (str(exc).strip().splitlines() or [""])[0][:100]
            out[n] = [{"setting": "chosen", "error": f"{type(exc).__name__}: {first}"}]
        if args.device == "cuda" and any("illegal" in r.get("error", "").lower() for r in out[n]):
            break
    return out


def validate_args(ap, args) -> None:
    """Sizes that would sweep nothing (a batch of 0), silently drop tokens or divide by zero: refused by flag."""
    for flag, value, low in (("--tokens", args.tokens, 1), ("--heads", args.heads, 1), ("--head-dim", args.head_dim, 1),
                             ("--landmarks", args.landmarks, 1), ("--repeat", args.repeat, 1),
                             ("--conv", args.conv, 1)):
        if value < low:
            ap.error(f"{flag}: must be at least {low}, got {value}")
    if args.conv % 2 == 0:
        ap.error(f"--conv: must be odd (the conv keeps the length, as model.conv_kernel_size), got {args.conv}")
    for n in args.lengths:
        if n < 1 or args.tokens % n:
            ap.error(f"--lengths {n}: every length must divide --tokens {args.tokens} (batch = tokens / n)")
        if args.landmarks > n:
            ap.error(f"--landmarks {args.landmarks}: more landmarks than tokens at --lengths {n}")
    if not 0 < args.margin <= 1e9:
        ap.error(f"--margin: must be positive, got {args.margin}")


def read_best(ap, path: str) -> dict:
    """An existing settings file's contents (its entries are kept unless this sweep replaces them)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        ap.error(f"--best {path}: cannot read it ({exc.strerror})")
    try:
        kept = json.loads(text)
    except json.JSONDecodeError as exc:
        ap.error(f"--best {path}: not JSON (line {exc.lineno}: {exc.msg}); remove it or name another file")
    if not isinstance(kept, dict) or not all(isinstance(v, dict) for v in kept.values()):
        ap.error(f"--best {path}: not a settings file (an object of dtypes, each an object of wrappers)")
    return kept


def flat(outputs):
    import torch
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for o in outputs for t in flat(o)] if isinstance(outputs, (tuple, list)) else []


def time_it(prepare, run_once, device, repeat: int) -> float:
    """Median ms of ``run_once(prepare())``, the preparation untimed (CUDA events on a GPU)."""
    import torch
    for _ in range(2):
        run_once(prepare())
    samples = []
    for _ in range(repeat):
        state = prepare()
        if device.type != "cuda":
            start = time.perf_counter()
            run_once(state)
            samples.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_once(state)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def child_argv(args, wrapper: str) -> list[str]:
    return [sys.executable, __file__, "--child", wrapper, "--lengths", *map(str, args.lengths), "--device",
            args.device, "--tokens", str(args.tokens), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
            "--landmarks", str(args.landmarks), "--conv", str(args.conv), "--dtype", args.dtype, "--repeat",
            str(args.repeat)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu (the interpreter)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per batch (batch = tokens / n)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--landmarks", type=int, default=64)
    ap.add_argument("--conv", type=int, default=33)
    ap.add_argument("--dtype", choices=["bf16", "fp32", "fp64"], default="bf16")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--wrappers", nargs="+", choices=WRAPPERS, default=WRAPPERS)
    ap.add_argument("--best", metavar="FILE",
                    help="write each wrapper's fastest setting (by the geometric mean over the lengths of × chosen, "
                         "if below --margin, and computing what the chosen one does at every length) as the "
                         "--dtype section of a NYSTROM_LAUNCH_SETTINGS file (an existing file's other dtypes are "
                         "kept)")
    ap.add_argument("--margin", type=float, default=0.97, help="a setting must time below this × chosen (noise)")
    ap.add_argument("--compile-workers", type=int, default=None, metavar="N",
                    help="first run every wrapper's process untimed (--repeat 1), N at a time: Triton compiles each "
                         "setting at its first launch, one at a time in a process, and its on-disk cache then "
                         "serves the timed runs, one at a time as before (default 8 on CUDA; 0 on the CPU, where "
                         "the interpreter compiles nothing)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:  # one wrapper at every length (each setting compiles once): its rows as JSON
        sys.path.insert(0, str(ROOT / "code"))
        print(json.dumps(child_sweep(args)))
        return
    validate_args(ap, args)
    previous = read_best(ap, args.best) if args.best else {}  # a bad file is refused before any sweep
    stop_on_sigterm()
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if args.device == "cpu" else {}))
    env.pop("NYSTROM_TRITON", None)
    # variations of the code's own settings: a settings file in force would shift some of them and not others
    ignored = env.pop("NYSTROM_LAUNCH_SETTINGS", None)
    print(f"# launch settings swept, {args.dtype}, {args.tokens:,} tokens a batch, {args.heads} heads × "
          f"{args.head_dim}, {args.landmarks} landmarks, conv {args.conv}, on {args.device}"
          + (" (Triton's interpreter: the times mean nothing, the differences do)" if args.device == "cpu" else "")
          + (f"; NYSTROM_LAUNCH_SETTINGS={ignored} not used: the sweep starts from the code's own settings"
             if ignored else ""))
    workers = workers_for(args.compile_workers, args.device)
    if workers > 0:  # every wrapper's process once, untimed (compile_first.py)
        untimed = argparse.Namespace(**{**vars(args), "repeat": 1})
        print(run_untimed([child_argv(untimed, wrapper) for wrapper in args.wrappers], env, workers), flush=True)
    # one table, a wrapper's rows printed as soon as its process ends: a run cut off at a time limit keeps them
    print("\n| wrapper | n | setting | launched with | programs | ms | × chosen | rel. diff. | max diff. |")
    print("|---|---|---|---|---|---|---|---|---|")
    swept, failed, stopped = {}, [], None
    try:
        for wrapper in args.wrappers:
            stopped = f"{wrapper}'s sweep"
            if not sweep_wrapper(wrapper, args, env, swept):
                failed.append(wrapper)
            if args.best:  # after each wrapper: a sweep cut off at its time limit keeps the best found so far
                write_best(Path(args.best), args.dtype, best_settings(swept, args.margin, args.dtype), swept,
                           previous)
        stopped = None
    except KeyboardInterrupt:
        pass  # stopped names the wrapper under way
    if args.best:
        best = best_settings(swept, args.margin, args.dtype)
        print(f"\n# the fastest setting of each wrapper below {args.margin} × chosen (geometric mean over n = "
              f"{', '.join(map(str, args.lengths))}), written to {args.best} for NYSTROM_LAUNCH_SETTINGS "
              f"({args.dtype} inputs, where the wrapper chooses what it chose here; conv {args.conv}):")
        for wrapper, (entry, score) in best.items():
            print(f"- {wrapper}: {setting_label({k: v for k, v in entry.items() if k != 'when'})} ({score:.2f} × "
                  f"chosen)")
        if not best:
            print("- none: every wrapper swept keeps its chosen settings")
        kept = sorted(set(previous.get(args.dtype, {})) - set(swept))
        if kept:
            print(f"- kept from the file, not swept here: {', '.join(kept)}")
    if failed:
        print(f"\nThe sweep of {', '.join(failed)} failed (its row above says why): the settings file keeps "
              f"what it held for {'it' if len(failed) == 1 else 'them'}.")
    if stopped:
        print(stopped_note(stopped) + " The settings file holds the best of the wrappers swept before it.")
        sys.exit(STOPPED_STATUS)
    if failed:
        sys.exit(1)


def write_best(path: Path, dtype: str, best: dict, swept: dict, previous: dict) -> None:
    """The settings file at ``path``: ``previous`` (its contents before this sweep) with the ``dtype`` entries of the
    wrappers swept here replaced by ``best``'s (or removed, where no setting beat the chosen one); other dtypes and
    the wrappers not swept here (or whose sweep failed) kept — a partial sweep never erases another's results.
    Written whole under a temporary name, flushed to disk and renamed."""
    kept = {d: dict(w) for d, w in previous.items()}
    section = {w: entry for w, entry in kept.get(dtype, {}).items() if w not in swept}
    section.update({w: entry for w, (entry, _) in best.items()})
    kept[dtype] = section
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        f.write(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def sweep_wrapper(wrapper: str, args, env: dict, swept: dict) -> bool:
    """One wrapper's sweep in a process of its own; its rows printed as soon as it ends, and kept in ``swept`` when
    its own settings ran. False when the process failed or its own settings raised (its row names the error)."""
    proc = subprocess.run(child_argv(args, wrapper), env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(f"| {wrapper} | | (the process failed: {process_error(proc)}) | | | | | | |", flush=True)
        return False
    result = json.loads(lines[-1])
    for n, rows in result.items():
        base = next((r.get("ms") for r in rows if r["setting"] == "chosen"), None)
        for r in rows:
            if "error" in r:
                print(f"| {wrapper} | {n} | {r['setting']} | failed: {r['error']} | | | | | |")
                continue
            ratio = f"{r['ms'] / base:.2f}" if base else "—"
            used = " ".join(f"{k}={v}" for k, v in r["launched"].items())
            print(f"| {wrapper} | {n} | {r['setting']} | {used} | {r['programs']} | {r['ms']:.3f} | {ratio} | "
                  f"{r['diff']:.1e} | {r.get('max_diff', 0.0):.1e}{'' if agrees(r, args.dtype) else ' (differs)'} |")
    sys.stdout.flush()
    # Swept (its file entry replaced) only when its own settings ran at every length where it launched: an error
    # there (the chosen setting's reference call, a fault) is a failure, and a wrapper that launched at no length
    # (the combine at short n) keeps its entry too
    chosen = [next((r for r in rows if r["setting"] == "chosen"), {}) for rows in result.values()]
    failed = [r for r in chosen if "error" in r and not r["error"].startswith("not launched")]
    if not failed and any("ms" in r for r in chosen):
        swept[wrapper] = result
    return not failed


def process_error(proc) -> str:
    """The line of a failed process's stderr that names its error: the last one naming an exception (PyTorch's
    CUDA errors end with a hint about TORCH_USE_CUDA_DSA below the error itself), else the last line."""
    lines = [line.strip() for line in proc.stderr.strip().splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
    return ((named or lines or [f"no output, exit status {proc.returncode}"])[-1])[:160]


def best_settings(swept: dict, margin: float, dtype: str) -> dict:
    """{wrapper: (entry, geometric mean of × chosen)} for the fastest setting of each wrapper that ran at every
    length where the wrapper launched, computed what the chosen one does there (``agrees``: sums in another order,
    within the dtype's tolerance) and timed below ``margin`` × chosen. Where a setting launched exactly as the chosen
    one (clamped to n), its ratio is 1: its time differs only by noise. The entry is the override with ``"when"``:
    the wrapper's own settings at the lengths swept, which the layer checks before applying it (another conv width
    or dtype size chooses otherwise, and the setting was never timed there); none where they differed by length."""
    best = {}
    for wrapper, by_n in swept.items():
        scores, ran, owns = {}, 0, []
        for rows in by_n.values():
            chosen_row = next((r for r in rows if r["setting"] == "chosen"), {})
            base = chosen_row.get("ms")
            if "own" in chosen_row:
                owns.append(chosen_row["own"])
            ran += base is not None or any(r["setting"] != "chosen" for r in rows)  # not "not launched at this n"
            for r in rows:
                if r["setting"] == "chosen":
                    continue
                ok = base and "ms" in r and agrees(r, dtype)
                ratio = r["ms"] / base if ok else None
                if ok and (r["launched"], r["programs"]) == (chosen_row["launched"], chosen_row["programs"]):
                    ratio = 1.0  # clamped to the chosen launch at this n (e.g. parts beyond the partials): noise
                scores.setdefault(r["setting"], (r["override"], []))[1].append(ratio)
        ranked = sorted((statistics.geometric_mean(ratios), label) for label, (_, ratios) in scores.items()
                        if len(ratios) == ran and None not in ratios)
        # one "when" for the entry: where the wrapper chose otherwise at some length, the setting was timed against
        # different own settings and no single condition says where it applies — no entry
        if ranked and ranked[0][0] < margin and all(o == owns[0] for o in owns):
            when = owns[0] if owns else {}
            best[wrapper] = ({**scores[ranked[0][1]][0], **({"when": when} if when else {})}, ranked[0][0])
    return best


if __name__ == "__main__":
    main()
