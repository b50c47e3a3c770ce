"""`jrt generate`: stream a continuation of a prompt from a JRT-RNN / Based checkpoint to stdout.

    jrt generate --model hazyresearch/JRT-360M-30B-hf --prompt "The capital of France is" --max-new-tokens 32
    jrt generate --model ./converted --prompt "..." --prefix-strategy repeat --jrt-prompt

The model is loaded with `AutoModelForCausalLM` (importing `modeling_jrt` registers `model_type = "jrt_rnn"`), the
prompt is read in parallel and the continuation is decoded token by token from the recurrent state and printed as it
is generated (`TextStreamer`).
"""

from __future__ import annotations

import argparse

from modeling_jrt.configuration_jrt import PREFIX_STRATEGIES


def read_twice(prompt: str) -> str:
    """JRT-Prompt in its simplest form: the prompt, a newline, the prompt again (REFERENCE.md §6)."""
    return f"{prompt}\n{prompt}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a continuation of a prompt",
        description="Generate from a JRT-RNN / Based checkpoint (local folder or Hub id), streaming to stdout.",
    )
    parser.add_argument("--model", required=True, help="checkpoint folder or Hub repo id")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument(
        "--prefix-strategy", choices=PREFIX_STRATEGIES, default=None,
        help="how prompts shorter than the JRT prefix are filled (default: the checkpoint's config)",
    )
    parser.add_argument("--jrt-prompt", action="store_true", help="read the prompt twice (JRT-Prompt)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own code")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    import modeling_jrt  # noqa: F401  (registers model_type "jrt_rnn" with the Auto classes)

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except OSError as error:  # missing folder, unknown Hub id, no network
        raise FileNotFoundError(f"cannot load a model and tokenizer from {args.model!r}: {error}") from error
    model.to(device).eval()

    prompt = read_twice(args.prompt) if args.jrt_prompt else args.prompt
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    torch.manual_seed(args.seed)
    sampling = {"do_sample": args.do_sample}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    model.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        prefix_strategy=args.prefix_strategy,
        streamer=TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **sampling,
    )
    return 0
