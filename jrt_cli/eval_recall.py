"""`jrt eval-recall`: read-once vs JRT-Prompt recall accuracy of any causal LM on a JSONL file of documents.

A thin front end over the lm-eval recall tasks (`jrt_eval.jsonl_recall`): it checks every argument, the data file and
the output path before loading the model, then prints the summary table to stdout and writes the per-record file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .choices import DTYPES, PROMPT_KINDS, integer_type
from .main import UsageError, quiet_transformers, require_lm_eval
from .sources import check_model_source

_positive_int, _non_negative_int = integer_type(1), integer_type(0)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval-recall",
        help="recall accuracy with the read-once prompt vs JRT-Prompt (document twice), through lm-eval",
        description=(
            "Greedy generation on recall-intensive documents with the read-once prompt and/or JRT-Prompt, scored by "
            "'contains' (case-insensitive match of any gold answer in the first line generated), run as the "
            "lm-eval tasks jrt_jsonl / jrt_jsonl_twice with the `jrt` model (needs the `eval` extra). Data: JSON "
            "Lines with 'context', 'key' (extraction) or 'question' (QA), 'answers', and optional 'header', "
            "'template', 'id'; see docs/evaluation.md."
        ),
    )
    parser.add_argument("--model", required=True, help="local folder or Hub id of an AutoModelForCausalLM")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: --model)")
    parser.add_argument("--data", required=True, help="JSONL file of records (context, key or question, answers)")
    parser.add_argument("--prompt", choices=(*PROMPT_KINDS, "both"), default="both", help="prompt kinds to score")
    parser.add_argument("--context-tokens", type=_positive_int, default=1000,
                        help="token budget of document plus answer; the document keeps this minus --answer-tokens")
    parser.add_argument("--answer-tokens", type=_non_negative_int, default=50,
                        help="tokens reserved for the answer (default 50)")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="prompts per generate call")
    parser.add_argument("--limit", type=_positive_int, default=None, help="evaluate only the first N records")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=48, help="greedy tokens per prompt (48)")
    parser.add_argument("--max-length", type=_positive_int, default=None,
                        help="the model window; longer prompts are left-truncated by lm-eval (default: the "
                             "model's max_position_embeddings, else 2048)")
    parser.add_argument("--output", default=None, help="write one JSON line per record and prompt kind here")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="float32")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow Hub remote code for model/tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="only errors from lm-eval's log")
    parser.set_defaults(func=run)


def load_lm(args: argparse.Namespace):
    """The `JRTLM` for `--model`; a missing folder or a failed load is one line (ValueError / RuntimeError)."""
    require_lm_eval("`jrt eval-recall` runs through")
    import torch

    from jrt_eval.lm import JRTLM

    for flag, name in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if name is not None:
            check_model_source(name, flag)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return JRTLM(pretrained=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=device,
                     batch_size=args.batch_size, trust_remote_code=args.trust_remote_code, max_length=args.max_length)
    except (OSError, ValueError) as error:  # transformers: missing files (OSError), no model_type (ValueError)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(f"cannot load --model {args.model}: {reason}") from None


def run(args: argparse.Namespace) -> int:
    # The arguments first, before anything heavy is imported (usage errors answer at once, exit 2).
    if args.context_tokens <= args.answer_tokens:
        raise UsageError(f"--context-tokens ({args.context_tokens}) must exceed --answer-tokens ({args.answer_tokens}):"
                         " the document window is their difference")
    if not Path(args.data).is_file():
        raise UsageError(f"no data file at {args.data}: pass a JSON Lines file of records (--data)")
    from jrt_eval.jsonl_recall import check_output_writable, evaluate_recall, load_records, quiet_lm_eval, write_results

    # Everything else that can be checked is checked before the model is loaded and the evaluation runs.
    if args.output:
        check_output_writable(args.output)
    load_records(args.data, limit=args.limit)
    if args.no_progress:
        quiet_lm_eval()
    quiet_transformers()
    lm = load_lm(args)
    report = evaluate_recall(
        lm, args.data, tokenizer_name=args.tokenizer or args.model,
        prompt_kinds=PROMPT_KINDS if args.prompt == "both" else (args.prompt,), context_tokens=args.context_tokens,
        answer_tokens=args.answer_tokens, max_new_tokens=args.max_new_tokens, limit=args.limit,
    )
    if args.output:
        write_results(args.output, report)
    print(report.format_table())
    return 0
