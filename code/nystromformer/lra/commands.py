"""``nystromformer listops-generate`` and ``nystromformer listops-train`` (LRA ListOps).

    nystromformer listops-generate --out data/listops            # 96k/2k/2k at LRA settings, seeded
    nystromformer listops-train --data data/listops --out results/listops          # paper scale (GPU if any)
    nystromformer listops-train --generate --train-size 2000 --max-depth 6 --min-length 64 --gen-max-length 256 \\
        --max-length 256 ...                                                     # reduced, e.g. CPU

``--data`` takes a folder with ``basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv`` (the LRA
release's ``listops-1000`` folder, or one written by ``listops-generate``).
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from dataclasses import replace
from pathlib import Path

from ..atomic import check_output_folder
from ..cli import add_subcommand
from ..config import ATTENTION_TYPES, ConfigError, ModelConfig
from ..errors import UserError
from ..runtime import check_environment, resolve_device
from . import listops
from .train import RunSettings, encode_splits, majority_accuracy, model_config, train_one, write_results

GEN_DOC = "Generate LRA ListOps TSVs (basic_train/val/test.tsv, Source<TAB>Target)."
TRAIN_DOC = __doc__


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-size", type=int, default=96000)
    p.add_argument("--dev-size", type=int, default=2000)
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--max-args", type=int, default=10)
    p.add_argument("--min-length", type=int, default=501,
                   help="fewest tokens of a generated expression (default: LRA's 500 < L)")
    p.add_argument("--gen-max-length", type=int, default=1999,
                   help="most tokens of a generated expression (default: LRA's L < 2000)")
    p.add_argument("--data-seed", type=int, default=0)


def check_generation_arguments(args) -> None:
    """Limits no tree can meet would keep the generator drawing for minutes before it gives up: refused here."""
    for flag, n in (("--train-size", args.train_size), ("--dev-size", args.dev_size), ("--test-size", args.test_size)):
        if n < 1:
            raise UserError(f"{flag}: must be at least 1, got {n}")
    if args.max_depth > listops.MAX_DEPTH:
        raise UserError(f"--max-depth: at most {listops.MAX_DEPTH} (LRA uses 10), got {args.max_depth}")
    if args.max_depth < 2:
        raise UserError(f"--max-depth: must be at least 2 (the root operator is depth 1, digits are depth "
                        f"--max-depth), got {args.max_depth}")
    if args.max_args < 2:
        raise UserError(f"--max-args: an operator takes 2 to --max-args arguments; must be at least 2, got "
                        f"{args.max_args}")
    shortest, longest = 4, listops.longest_tree(args.max_depth, args.max_args)  # shortest: [OP d d ]
    if args.gen_max_length < shortest:
        raise UserError(f"--gen-max-length: the shortest expression has {shortest} tokens, got {args.gen_max_length}")
    if args.min_length > args.gen_max_length:
        raise UserError(f"--min-length {args.min_length} is above --gen-max-length {args.gen_max_length}")
    if args.min_length > longest:
        raise UserError(f"--min-length: trees of --max-depth {args.max_depth} with --max-args {args.max_args} have "
                        f"at most {longest} tokens, got {args.min_length}")


def generate_from_args(args) -> dict:
    check_generation_arguments(args)
    # Held-out splits first: the test and dev sets stay the same trees whatever --train-size (cut train-first before
    # 2026-11-29, so runs with other training sizes were scored on other test sets)
    sizes = {"test": args.test_size, "dev": args.dev_size, "train": args.train_size}
    return listops.generate_splits(sizes, seed=args.data_seed, max_depth=args.max_depth, max_args=args.max_args,
                                   min_length=args.min_length, max_length=args.gen_max_length)


def add_gen_arguments(p):
    p.add_argument("--out", type=Path, required=True, help="folder for basic_{train,val,test}.tsv")
    add_generation_arguments(p)


def run_generate(args) -> int:
    check_output_folder(args.out, "--out")
    splits = generate_from_args(args)
    for split, rows in splits.items():
        listops.write_tsv(args.out / listops.SPLIT_FILES[split], rows)
        print(f"{split}: {len(rows)} rows -> {args.out / listops.SPLIT_FILES[split]}")
    return 0


# The model keys the run flags fill in (lra/train.py, model_config), for errors in the user's terms
FLAGS_OF_KEY = {"transformer_dim": "--dim", "embedding_dim": "--dim", "head_dim": "--dim / --num-head",
                "num_head": "--num-head", "transformer_hidden_dim": "--ffn-dim", "num_layers": "--num-layers",
                "dropout_prob": "--dropout", "max_seq_len": "--max-length"}
# Model keys a flag or the data decides: a --set of them would train another model than the table names.
FLAG_OWNED_KEYS = {
    "attn_type": "the attention is chosen by --attn-types (the results table is labelled by it)",
    "max_seq_len": "set by --max-length (what the data is truncated to)",
    "vocab_size": "fixed by the ListOps vocabulary", "pad_token_id": "fixed by the ListOps vocabulary",
    "embedding_dim": "set by --dim", "transformer_dim": "set by --dim", "head_dim": "--dim / --num-head",
    "num_head": "set by --num-head", "num_layers": "set by --num-layers", "transformer_hidden_dim": "set by --ffn-dim",
    "dropout_prob": "set by --dropout",
}


def add_train_arguments(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="folder with the LRA ListOps TSVs")
    src.add_argument("--generate", action="store_true", help="generate the data in memory (flags below)")
    add_generation_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="folder for listops_results.{md,csv} and the log")
    p.add_argument("--attn-types", default=",".join(ATTENTION_TYPES),
                   help="comma-separated attention types (default: all)")
    d = RunSettings()
    for name, val in d.__dict__.items():
        flag = "--" + name.replace("_", "-")
        if name == "eval_batches":
            p.add_argument(flag, type=int, default=None, help="dev batches per evaluation (default: all)")
        elif name == "device":
            p.add_argument(flag, default=None, help="cpu, cuda or cuda:N (default: cuda when there is a GPU, else cpu)")
        elif name == "time_limit_s":
            p.add_argument(flag, type=float, default=None,
                           help="stop each run's training after this many seconds (then dev + test on the best "
                                "checkpoint; the table's steps column shows how far it got)")
        else:
            p.add_argument(flag, type=type(val), default=val)
    p.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="train each attention type once per seed (overrides --seed); the table adds mean ± std")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a model key for every run, e.g. --set num_landmarks=32 (repeatable)")
    p.add_argument("--title", default="ListOps")


def _refuse_repeats(flag: str, values: list) -> None:
    repeated = [str(v) for i, v in enumerate(values) if v in values[:i]]
    if repeated:
        raise UserError(f"{flag}: {', '.join(dict.fromkeys(repeated))} given more than once")


def train_plan(args) -> tuple[list[str], dict, RunSettings, list[int]]:
    """The runs ``args`` ask for — attention types, --set overrides, settings, seeds — each run's model checked, as
    a UserError naming the flag; nothing read or written, no device touched (also what a dry run of the
    command checks: cli.validate_args)."""
    names = [a.strip() for a in args.attn_types.split(",") if a.strip()]
    if not names:
        raise UserError(f"--attn-types: give at least one of {', '.join(ATTENTION_TYPES)}")
    bad = [a for a in names if a not in ATTENTION_TYPES]
    if bad:
        raise UserError(f"--attn-types: unknown attention type(s) {', '.join(bad)} (known: "
                        f"{', '.join(ATTENTION_TYPES)})")
    _refuse_repeats("--attn-types", names)
    overrides = {}
    for item in args.set:
        key, _, val = item.partition("=")
        key = key.removeprefix("model.")  # the key as config.json's "model" section spells it, or with the section
        if key not in ModelConfig.__dataclass_fields__:
            raise UserError(f"--set {item}: {key!r} is not a model key (config.json's \"model\" section: "
                            f"docs/config.md), e.g. --set num_landmarks=32")
        try:
            overrides[key] = json.loads(val)
        except json.JSONDecodeError:
            raise UserError(f"--set {item}: the value must be JSON, e.g. --set num_landmarks=32 or "
                            f"--set linformer_sharing='\"kv\"'") from None
        if key in FLAG_OWNED_KEYS:
            raise UserError(f"--set {key}: {FLAG_OWNED_KEYS[key]}")
    settings = RunSettings(**{k: getattr(args, k) for k in RunSettings().__dict__})
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [settings.seed]
    except ValueError:
        raise UserError(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    _refuse_repeats("--seeds", seeds)  # the same run twice would count as two seeds of spread 0
    for name in names:  # every run's settings checked before the first one trains
        try:
            model_config(name, settings, overrides)
        except ConfigError as e:  # named by the flags the user typed, not the config keys they fill
            key = (e.key or "").removeprefix("model.")
            flags = (f"--set {key}" if key in overrides else FLAGS_OF_KEY.get(key))
            if flags is None:
                raise
            raise UserError(f"{flags}: {e.reason} (the {name} run's model)") from None
    return names, overrides, settings, seeds


def run_train(args) -> int:
    names, overrides, settings, seeds = train_plan(args)
    check_environment()
    resolve_device(settings.device)
    check_output_folder(args.out, "--out")
    raw = listops.load_lra_dir(args.data) if args.data else generate_from_args(args)
    splits = encode_splits(raw, settings.max_length)
    args.out.mkdir(parents=True, exist_ok=True)
    # Appended to, so that the runs of earlier calls stay; each call starts with a "start" record, and every
    # record names its attention type and seed, so curves split by call, type and seed.
    with open(args.out / "listops_log.jsonl", "a") as log_file:
        def log(line):
            print(line, flush=True)
            log_file.write(line + "\n")
            log_file.flush()

        log(json.dumps({"event": "start", "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "attn_types": names, "seeds": seeds, "settings": settings.__dict__, "set": overrides,
                        "data": str(args.data) if args.data else "generated"}))

        results = []
        for name in names:
            for seed in seeds:
                results.append(train_one(name, splits, replace(settings, seed=seed), overrides, log))
                log(json.dumps({"result": results[-1]}))
                write_results(results, args.out, args.title, settings,
                              majority_accuracy(splits["train"], splits["test"]))
    print((args.out / "listops_results.md").read_text())
    return 0


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "listops-generate", "generate LRA ListOps TSV files", GEN_DOC, add_gen_arguments,
                   run_generate)
    add_subcommand(subparsers, "listops-train", "train/evaluate ListOps for attention types; results table",
                   TRAIN_DOC, add_train_arguments, run_train, check=train_plan)
