"""``steadytrain tokenize INPUT... --out DEST``: raw text (or a Megatron .bin/.idx, or datatrove
``.ds`` files) → dataset."""

from __future__ import annotations

import argparse
import sys

HELP = "tokenize JSON Lines / Parquet / text files into a token-shard dataset"
DESCRIPTION = (
    "Tokenize inputs (JSON Lines, Parquet, text files, directories of them) into a "
    "token-shard dataset at DEST (a local path or an fsspec URL). EOS is appended to "
    "every document. Non-UTF-8 bytes are replaced with U+FFFD and reported per file. "
    "Or import a Megatron-LM .bin/.idx pair with --from-megatron PREFIX, or datatrove's "
    "tokenized output (.ds/.ds.index files) with --from-datatrove PATH."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files or directories")
    p.add_argument("--out", required=True, metavar="DEST", help="new dataset directory or URL")
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default, vocab 257, EOS 256) | PATH/tokenizer.json | train:VOCAB",
    )
    p.add_argument(
        "--tokenizer-sample-bytes",
        type=int,
        default=None,
        metavar="N",
        help="with --tokenizer train:VOCAB: train on a deterministic sample of at most N bytes "
        "of text, drawn evenly from all inputs (long documents in 64 KiB pieces), which bounds "
        "the trainer's memory; recorded in the manifest (default 67108864 = 64 MiB; min 1 MiB)",
    )
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 64Mi)")
    p.add_argument("--workers", type=int, default=None, help="encoder processes (default: CPUs)")
    p.add_argument("--text-field", default="text", help="JSON Lines / Parquet text field")
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="also read files matching GLOB when walking a directory (repeatable; matched "
        "against the path below the directory and the file name), e.g. 'LICENSE*' or '*'",
    )
    p.add_argument("--from-megatron", metavar="PREFIX", help="import PREFIX.bin / PREFIX.idx")
    p.add_argument(
        "--from-datatrove",
        metavar="PATH",
        help="import datatrove's DocumentTokenizer / merger output: a folder of .ds files (with "
        ".ds.index and .ds.metadata beside each) or one .ds file",
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="(--from-megatron/-datatrove) vocabulary size"
    )
    p.add_argument("--eos-id", type=int, default=None, help="(--from-megatron/-datatrove) EOS id")
    p.add_argument(
        "--token-size",
        type=int,
        choices=(2, 4),
        default=None,
        help="(--from-datatrove) bytes per token id, needed only when .ds.metadata is missing",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from steadytrain.commands._util import print_json
    from steadytrain.data.ingest.progress import make_progress
    from steadytrain.data.ingest.writer import DEFAULT_SHARD_TOKENS
    from steadytrain.errors import ConfigError

    def warn(msg: str) -> None:
        print(f"steadytrain tokenize: warning: {msg}", file=sys.stderr)

    shard_tokens = args.shard_tokens or DEFAULT_SHARD_TOKENS
    if args.from_megatron and args.from_datatrove:
        raise ConfigError("give --from-megatron or --from-datatrove, not both")
    if args.from_datatrove:
        if args.inputs:
            raise ConfigError("--from-datatrove takes no INPUT arguments (only the PATH)")
        from steadytrain.data.ingest.datatrove import import_datatrove

        result = import_datatrove(
            args.from_datatrove,
            args.out,
            tokenizer=None if args.tokenizer == "bytes" else args.tokenizer,
            vocab_size=args.vocab_size,
            eos_id=args.eos_id,
            token_size=args.token_size,
            progress=make_progress(args.quiet),
        )
    elif args.from_megatron:
        if args.inputs:
            raise ConfigError("--from-megatron takes no INPUT arguments (only the PREFIX)")
        from steadytrain.data.ingest.megatron import import_megatron

        tok = None if args.tokenizer == "bytes" else args.tokenizer
        result = import_megatron(
            args.from_megatron,
            args.out,
            tokenizer=tok,
            vocab_size=args.vocab_size,
            eos_id=args.eos_id,
            progress=make_progress(args.quiet),
        )
    else:
        if not args.inputs:
            raise ConfigError(
                "give at least one INPUT (file or directory), or --from-megatron / --from-datatrove"
            )
        from steadytrain.data.ingest.tokenize import tokenize

        sample_kw = {}
        if args.tokenizer_sample_bytes is not None:
            if not args.tokenizer.startswith("train:"):
                raise ConfigError(
                    f"--tokenizer-sample-bytes applies to --tokenizer train:VOCAB only (got "
                    f"--tokenizer {args.tokenizer}); drop it or train a tokenizer"
                )
            sample_kw["tokenizer_sample_bytes"] = args.tokenizer_sample_bytes
        result = tokenize(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            shard_tokens=shard_tokens,
            workers=args.workers,
            text_field=args.text_field,
            progress=make_progress(args.quiet),
            warn=warn,
            include=args.include,
            **sample_kw,
        )
    info = result.to_json()
    if args.json:
        print_json(info)
        return 0
    if info["up_to_date"]:
        print(f"{args.out} is up to date (fingerprint {info['fingerprint']})")
        return 0
    print(
        f"wrote {args.out}: {info['num_tokens']:,} tokens, {info['num_docs']:,} documents, "
        f"{info['num_shards']} shard(s), {info['dtype']}, vocab {info['vocab_size']}, "
        f"{info['seconds']:.1f} s ({info['tokens_per_s'] / 1e6:.2f} M tokens/s)\n"
        f"fingerprint {info['fingerprint']}"
    )
    return 0
