"""``nystromformer`` subcommands of the data pipeline: extract-wiki, preprocess, train-tokenizer, build-shards."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..atomic import check_output_folder, check_writable_folder
from ..cli import add_subcommand
from ..errors import UserError
from .readers import INPUT_PATTERNS, MIN_WORDS, READERS, SENTENCES_PER_DOCUMENT, SkipLog, expand_inputs
from .wiki import MAX_PROCESSES


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")


def _check_exists(paths, what: str) -> None:
    """The user-given paths exist: checked here so that a mistake is an InputError, reported in one line."""
    from .partitions import InputError
    for path in map(Path, paths):
        if not (path.is_file() or path.is_dir()):
            raise InputError(f"{path}: {what} does not exist")


def cmd_extract_wiki(args) -> int:
    from .wiki import extract_wiki
    check_output_folder(args.output)
    _logging()
    return extract_wiki(args.dump, args.output, args.processes, args.bytes, overwrite=args.overwrite)


def cmd_preprocess(args) -> int:
    from .partitions import InputError, PartitionError, write_partitions
    check_output_folder(args.output, inputs=args.input)
    check_writable_folder(args.output, "--output")  # else the first write names its hidden temporary file
    _logging()
    options = {}
    if args.dataset == "bookcorpus" and args.document_per_file:
        if args.sentences_per_document is not None:
            raise PartitionError("--sentences-per-document does not apply with --document-per-file "
                                 "(each book file is one document)")
        options = {"document_per_file": True}
    elif args.dataset == "bookcorpus":
        sentences = SENTENCES_PER_DOCUMENT if args.sentences_per_document is None else args.sentences_per_document
        if sentences < 1:
            raise PartitionError(f"--sentences-per-document must be at least 1, got {sentences}")
        options = {"document_per_file": False, "sentences_per_document": sentences}
    elif args.document_per_file or args.sentences_per_document is not None:
        raise PartitionError("--document-per-file and --sentences-per-document are bookcorpus options")
    _check_exists(args.input, "input")
    files = expand_inputs(args.input, INPUT_PATTERNS[args.dataset])
    if not files:
        raise InputError(f"no {args.dataset} input files under {' '.join(map(str, args.input))} "
                         f"(looked for {INPUT_PATTERNS[args.dataset]})")
    skips = SkipLog()
    reader = READERS[args.dataset]
    documents = reader(files, skips, **options)
    min_words = MIN_WORDS[args.dataset] if args.min_words is None else args.min_words
    write_partitions(documents, args.output, args.dataset, skips, args.words_per_partition, min_words,
                     inputs=[str(f) for f in files], reader_options=options)
    return 0


def cmd_train_tokenizer(args) -> int:
    from .tokenize import train_tokenizer
    check_output_folder(args.output)
    existing = [n for n in ("vocab.json", "merges.txt", "tokenizer.json") if (args.output / n).is_file()]
    if existing and not args.overwrite:
        raise UserError(f"--output {args.output}: holds a tokenizer already ({', '.join(existing)}); shards and models "
                        f"built with it would no longer match it. Choose a new folder, or --overwrite")
    _logging()
    train_tokenizer(args.input, args.output, args.vocab_size, args.min_frequency)
    return 0


def cmd_build_shards(args) -> int:
    from .build import build_shards, parse_dataset
    check_output_folder(args.output)
    _logging()
    build_shards([parse_dataset(d) for d in args.datasets], args.output, args.tokenizer, args.seq_len,
                 args.shard_size, args.dev_fraction, args.seed, args.workers, dev_run=args.dev_run)
    return 0


def add_extract_wiki_arguments(p) -> None:
    p.add_argument("--dump", type=Path, required=True, help="enwiki-*-pages-articles.xml.bz2")
    p.add_argument("--output", type=Path, required=True, help="folder for wikiextractor's <doc> files")
    p.add_argument("--processes", type=int, default=min(os.cpu_count() or 1, MAX_PROCESSES))
    p.add_argument("--bytes", default="100M", help="size of each output file (wikiextractor --bytes)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the wiki_* files of an earlier extraction in --output first (without it, such files "
                        "are an error: preprocess would read them beside the new ones)")


def add_preprocess_arguments(p) -> None:
    from .partitions import WORDS_PER_PARTITION
    p.add_argument("dataset", choices=sorted(READERS))
    p.add_argument("--input", type=Path, nargs="+", required=True,
                   help="input files or folders (wiki: wikiextractor output; bookcorpus: books_large_p*.txt, or a "
                        "folder of per-book .txt with --document-per-file; stories: folder of .txt; "
                        "realnews: realnews.jsonl)")
    p.add_argument("--output", type=Path, required=True, help="partition folder")
    p.add_argument("--words-per-partition", type=int, default=WORDS_PER_PARTITION)
    p.add_argument("--min-words", type=int, default=None,
                   help="drop shorter documents (default: wiki 128, realnews 1000, others 0)")
    p.add_argument("--sentences-per-document", type=int, default=None,
                   help=f"bookcorpus only: sentences grouped into one document (default {SENTENCES_PER_DOCUMENT}); "
                        f"a blank line also ends one")
    p.add_argument("--document-per-file", action="store_true",
                   help="bookcorpus only: one .txt file per book, blank lines between paragraphs; each file is one "
                        "document (default: the books_large_p*.txt layout, see --sentences-per-document)")


def add_train_tokenizer_arguments(p) -> None:
    p.add_argument("--input", type=Path, nargs="+", required=True, help="partition folders")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=50265)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--overwrite", action="store_true",
                   help="replace a tokenizer already in --output (shards built with it will no longer match it)")


def add_build_shards_arguments(p) -> None:
    from .build import DEV_RUN, SHARD_SIZE
    p.add_argument("datasets", nargs="+", metavar="PARTITIONS_DIR[:RATIO]",
                   help="partition folders, each with an optional sampling ratio in (0, 1] (paper: wiki and "
                        "bookcorpus 1, realnews and stories 0.333)")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--tokenizer", default="roberta-base", help="tokenizer folder or cached Hugging Face name")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--shard-size", type=int, default=SHARD_SIZE, help="sequences per shard")
    p.add_argument("--dev-fraction", type=float, default=0.1)
    p.add_argument("--dev-run", type=int, default=DEV_RUN,
                   help="runs of this many x 510 tokens of a partition file go to dev or train together (8192: "
                        "the paper's files of 8192 sequences of 512); measured in text, so every --seq-len puts the "
                        "same text in dev")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes encoding partition files in parallel")


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "extract-wiki", "extract article text from a Wikipedia XML dump (wikiextractor)",
                   "Extract article text from a Wikipedia XML dump with wikiextractor (step 2 of "
                   "data-preprocessing/README.md).", add_extract_wiki_arguments, cmd_extract_wiki)
    add_subcommand(subparsers, "preprocess", "read one corpus into plain-text partitions",
                   "Read one corpus into plain-text partitions (step 3 of data-preprocessing/README.md).",
                   add_preprocess_arguments, cmd_preprocess)
    add_subcommand(subparsers, "train-tokenizer", "train a byte-level BPE (RoBERTa special tokens)",
                   "Train a byte-level BPE with RoBERTa's special tokens on partition folders.",
                   add_train_tokenizer_arguments, cmd_train_tokenizer)
    add_subcommand(subparsers, "build-shards", "tokenise partitions into fixed-length sequence shards",
                   "Tokenise partitions into fixed-length sequence shards (step 5 of data-preprocessing/README.md; "
                   "formats in docs/data.md).", add_build_shards_arguments, cmd_build_shards)
