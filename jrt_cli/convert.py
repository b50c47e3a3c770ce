"""`jrt convert SRC DST`: convert a released HazyResearch JRT-RNN / Based checkpoint, optionally upload it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .choices import DTYPES, FAMILIES, PREFIX_PAD_MASKINGS
from .main import UsageError, quiet_transformers
from .sources import check_hub_source


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        usage="jrt convert [options] SRC DST\n       jrt convert --example DIR",
        help="convert a HazyResearch JRT-RNN / Based checkpoint to a HuggingFace folder",
        description="Convert a released HazyResearch JRT-RNN / Based checkpoint (reference config.json plus "
        "pytorch_model.bin or a Lightning .ckpt, or a Hub repo id) to a folder that "
        "AutoModelForCausalLM.from_pretrained loads, with or without the jrt-rnn package (trust_remote_code=True).",
    )
    parser.add_argument("source", metavar="SRC", nargs="?", help="local folder / weights file, or a Hub repo id")
    parser.add_argument("destination", metavar="DST", nargs="?",
                        help="output folder (must not exist unless --overwrite)")
    parser.add_argument("--example", metavar="DIR",
                        help="instead of converting: write a tiny random checkpoint in the released JRT-RNN format to "
                             "DIR (config.json + pytorch_model.bin, 14 MB, and a tokenizer that fits it in "
                             "DIR/tokenizer), to try `jrt convert DIR OUT --tokenizer DIR/tokenizer` offline")
    parser.add_argument("--family", default="auto", choices=["auto", *FAMILIES],
                        help="checkpoint family (default: detected from the config and the weights)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights dtype (default float32)")
    parser.add_argument("--tokenizer", metavar="PATH_OR_ID",
                        help="GPT-2 tokenizer to ship (folder or Hub id); default: GPT-2 from the local Hub cache if "
                             "present")
    parser.add_argument("--prefix-pad-masking", default="reference", choices=PREFIX_PAD_MASKINGS,
                        help="JRT prefix pads: 'reference' reproduces the published evaluation (pads keep a "
                             "constant-term contribution), 'strict' removes them entirely (default: reference)")
    parser.add_argument("--prefix-pad-token-id", type=int, metavar="ID",
                        help="token that fills a short JRT prefix (default: the tokenizer's ' ', else GPT-2's ' ' = "
                             "220); needed for a checkpoint whose vocabulary has 220 tokens or fewer")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="safetensors shard size, e.g. 5GB, 500MB or 2GiB (default 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace DST once the new folder is verified; only a folder an earlier `jrt convert` "
                             "wrote, file for file and unchanged (its jrt_convert_manifest.json), is ever replaced")
    hub = parser.add_argument_group("upload")
    hub.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the converted folder to this Hub repo")
    hub.add_argument("--private", action="store_true", help="create the Hub repo as private")
    hub.add_argument("--revision", help="branch to upload to (created when missing; default main)")
    hub.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.example is not None:
        if args.source is not None or args.destination is not None:
            raise UsageError("--example DIR writes an example checkpoint and converts nothing: give no SRC or DST.")
        from jrt_convert.source_files import check_example_folder

        try:
            check_example_folder(Path(args.example))  # before the seconds of importing torch
        except FileExistsError as error:
            raise UsageError(f"--example {error}") from None
        from jrt_convert.example import write_example_checkpoint

        folder = write_example_checkpoint(args.example)
        print(f"wrote a tiny random JRT-RNN checkpoint in the released format to {folder} (its tokenizer in "
              f"{folder / 'tokenizer'}); convert it with: jrt convert {folder} {folder}-hf --tokenizer "
              f"{folder / 'tokenizer'}")
        return 0
    if args.source is None or args.destination is None:
        raise UsageError("give the checkpoint to convert and the output folder: jrt convert SRC DST "
                         "(or jrt convert --example DIR for a tiny checkpoint to try it on).")
    if (args.private or args.revision or args.create_pr) and not args.push_to_hub:
        raise UsageError("--private, --revision and --create-pr need --push-to-hub REPO_ID.")
    if args.create_pr and args.revision not in (None, "main"):
        raise UsageError("--create-pr opens a pull request against main; it "
                         f"cannot be combined with --revision {args.revision!r}.")
    check_local_source(args.source)
    # A Hub id with the Hub unreachable fails in seconds (transformers and huggingface_hub retry for a minute).
    check_hub_source(
        args.source, "SRC", hint=f" Without network access, copy config.json and pytorch_model.bin from "
        f"https://huggingface.co/{args.source} into a folder and pass that folder as SRC.",
    )
    if args.tokenizer is not None:
        check_hub_source(args.tokenizer, "--tokenizer")
    from jrt_convert import OptionError, convert_checkpoint, push_to_hub
    from jrt_convert.hub import check_hub_access
    from jrt_convert.pipeline import check_options

    quiet_transformers()
    options = {name: getattr(args, name) for name in (
        "family", "dtype", "tokenizer", "prefix_pad_masking", "prefix_pad_token_id", "max_shard_size", "overwrite"
    )}
    try:
        check_options(args.destination, **options)
        if args.push_to_hub:
            check_hub_access(args.push_to_hub, private=args.private)  # before the minutes of conversion
        result = convert_checkpoint(args.source, args.destination, **options)
    except OptionError as error:  # an option that cannot work: a usage error (exit 2), whenever it is found
        raise UsageError(str(error)) from error
    print(f"family: {result.family} ({result.evidence})")
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"converted {result.source} -> {result.destination} ({result.num_parameters:,} parameters, "
          f"{len(result.files)} files)")
    if args.push_to_hub:
        url = push_to_hub(
            result.destination, args.push_to_hub, private=args.private, revision=args.revision, create_pr=args.create_pr
        )
        print(f"uploaded to {url}")
    return 0


def check_local_source(source: str) -> None:
    """A local SRC that is not a released checkpoint, found before torch is imported (`jrt_convert.source_files`): a
    folder without weights or an already converted one is a usage error (exit 2), a config.json that is not JSON a
    damaged file (exit 1)."""
    path = Path(source).expanduser()
    if not path.exists():
        return
    from jrt_convert.source_files import NotACheckpointError, find_weights_file, load_reference_config

    try:
        weights = find_weights_file(path)
    except NotACheckpointError as error:
        raise UsageError(f"SRC: {error}") from None
    load_reference_config(weights.parent)
