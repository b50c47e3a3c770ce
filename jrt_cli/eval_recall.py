"""`jrt eval-recall`: read-once vs JRT-Prompt recall accuracy of any causal LM on a JSONL file of documents.

The logic lives in `jrt_cli.recall_eval`; this module only parses arguments, prints the summary table to stdout and
writes the per-record file.
"""

from __future__ import annotations

import argparse

from .recall_eval import PROMPT_KINDS, evaluate_recall, load_model_and_tokenizer, load_records, write_results


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval-recall",
        help="recall accuracy with the read-once prompt vs JRT-Prompt (document twice)",
        description=(
            "Greedy generation on recall-intensive documents with the read-once prompt and/or JRT-Prompt, scored by "
            "'contains' (case-insensitive match of any gold answer in the first line generated). Data: JSON Lines "
            "with 'context', 'key' (extraction) or 'question' (QA), 'answers', and optional 'header', 'template', "
            "'id'; see the README."
        ),
    )
    parser.add_argument("--model", required=True, help="local folder or Hub id of an AutoModelForCausalLM")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: --model)")
    parser.add_argument("--data", required=True, help="JSONL file of records (context, key or question, answers)")
    parser.add_argument("--prompt", choices=(*PROMPT_KINDS, "both"), default="both", help="prompt kinds to score")
    parser.add_argument("--context-tokens", type=_positive_int, default=1000,
                        help="token budget of document plus answer; the document keeps this minus --answer-tokens")
    parser.add_argument("--answer-tokens", type=int, default=50, help="tokens reserved for the answer (default 50)")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="prompts per generate call")
    parser.add_argument("--limit", type=_positive_int, default=None, help="evaluate only the first N records")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=48, help="greedy tokens per prompt (48)")
    parser.add_argument("--max-length", type=_positive_int, default=None,
                        help="skip records whose prompt + new tokens exceed this (default: the model's "
                             "max_position_embeddings, none for JRT-RNN)")
    parser.add_argument("--output", default=None, help="write one JSON line per record and prompt kind here")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow Hub remote code for model/tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    records = load_records(args.data, limit=args.limit)
    model, tokenizer = load_model_and_tokenizer(
        args.model,
        tokenizer_name=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )
    report = evaluate_recall(
        model,
        tokenizer,
        records,
        prompt_kinds=PROMPT_KINDS if args.prompt == "both" else (args.prompt,),
        context_tokens=args.context_tokens,
        answer_tokens=args.answer_tokens,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
        progress=not args.no_progress,
    )
    if args.output:
        write_results(args.output, report)
    print(report.format_table())
    return 0
