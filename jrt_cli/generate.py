"""`jrt generate`: stream a continuation of a prompt from a JRT-RNN / Based checkpoint to stdout.

    jrt generate --model hazyresearch/JRT-360M-30B-hf --prompt "The capital of France is" --max-new-tokens 32
    jrt generate --model ./converted --prompt "..." --prefix-strategy repeat --jrt-prompt

The model is loaded with `AutoModelForCausalLM` (importing `modeling_jrt` registers `model_type = "jrt_rnn"`), the
prompt is read in parallel and the continuation is decoded token by token from the recurrent state and printed as it
is generated (`TextStreamer`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .choices import PREFIX_STRATEGIES, integer_type
from .main import UsageError, one_line, quiet_transformers
from .sources import check_model_source

# Files of which a saved tokenizer has at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
MAX_SEED = 2**64 - 1  # torch.manual_seed takes a 64-bit seed


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="stream a continuation of a prompt",
        description="Generate from a JRT-RNN / Based checkpoint (local folder or Hub id), streaming to stdout.",
    )
    parser.add_argument("--model", required=True, help="checkpoint folder or Hub repo id")
    parser.add_argument("--tokenizer", metavar="PATH_OR_ID", default=None,
                        help="tokenizer folder or Hub id (default: the one saved with --model; a converted folder "
                             "without one needs e.g. --tokenizer gpt2)")
    parser.add_argument("--prompt", required=True, help="text to continue (echoed as given, then the continuation)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--prefix-strategy", choices=PREFIX_STRATEGIES, default=None,
                        help="how prompts shorter than the JRT prefix are filled (default: the checkpoint's config)")
    parser.add_argument("--jrt-prompt", action="store_true", help="read the prompt twice (JRT-Prompt)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature > 0 (needs --do-sample)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling threshold in (0, 1] (needs --do-sample)")
    parser.add_argument("--seed", type=integer_type(0, MAX_SEED, "an integer in [0, 2**64 - 1]"), default=0,
                        help="random seed for sampling, 0 .. 2**64 - 1 (default 0)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own code")
    parser.set_defaults(func=run)


def check_arguments(args: argparse.Namespace) -> None:
    """Usage errors (exit code 2), before anything is loaded or printed."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if not args.prompt:
        raise UsageError("--prompt is empty: give some text to continue.")
    if not args.do_sample and (args.temperature is not None or args.top_p is not None):
        raise UsageError("--temperature and --top-p set how to sample: add --do-sample (greedy decoding ignores them).")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UsageError("--temperature must be a finite number > 0, got "
                         f"{args.temperature} (for greedy decoding, leave out --do-sample).")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}.")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    device = resolve_device(args.device)
    check_model_source(args.model, "--model")
    if args.tokenizer is not None:
        check_model_source(args.tokenizer, "--tokenizer")

    import torch
    from transformers import AutoModelForCausalLM

    import modeling_jrt  # noqa: F401  (registers model_type "jrt_rnn" with the Auto classes)
    from jrt_prompt import read_twice

    quiet_transformers()  # no "Loading weights" bar before the output
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except OSError as error:  # missing files, unknown Hub id
        raise FileNotFoundError(f"cannot load a model from {args.model!r}: {one_line(error)}") from error
    explicit = args.tokenizer is not None
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code, explicit=explicit)
    model.to(device).eval()
    warn_unfit_tokenizer(tokenizer, model.config)

    prompt = read_twice(args.prompt) if args.jrt_prompt else args.prompt
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    if inputs["input_ids"].shape[1] == 0:
        raise UsageError(f"--prompt {args.prompt!r} encodes to 0 tokens with this tokenizer: give some text.")
    torch.manual_seed(args.seed)
    sampling = {name: value for name, value in (("temperature", args.temperature), ("top_p", args.top_p))
                if value is not None}
    output = model.generate(
        **inputs, max_new_tokens=args.max_new_tokens, prefix_strategy=args.prefix_strategy,
        streamer=prompt_echo_streamer(tokenizer, prompt), do_sample=args.do_sample, **sampling,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    explain_a_blank_continuation(tokenizer, inputs["input_ids"][0].tolist(), output[0].tolist())
    return 0


def warn_unfit_tokenizer(tokenizer, config) -> None:
    """Say on stderr when the model can generate ids the tokenizer cannot decode (they print as nothing)."""
    generated = getattr(config, "generation_vocab_size", None) or config.vocab_size
    if len(tokenizer) < generated:
        print(
            f"note: the tokenizer has {len(tokenizer):,} tokens but the model generates ids up to {generated - 1:,}: "
            "ids the tokenizer lacks print as nothing. Pass the tokenizer the model was trained with (--tokenizer).",
            file=sys.stderr)


def explain_a_blank_continuation(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> None:
    """Say on stderr why nothing was printed after the prompt: the new tokens are special tokens (which print as
    nothing), and the prompt held words the tokenizer does not know (read as its unknown token), if it did."""
    new_ids = output_ids[len(prompt_ids):]
    if not new_ids or tokenizer.decode(new_ids, skip_special_tokens=True).strip():
        return
    sys.stdout.flush()
    shown = " ".join(tokenizer.convert_ids_to_tokens(new_ids[:8])) + (" ..." if len(new_ids) > 8 else "")
    print(f"note: the {len(new_ids)} generated token(s) print as nothing ({shown}: special or empty tokens).",
          file=sys.stderr)
    unknown = tokenizer.unk_token_id
    if unknown is not None and unknown in prompt_ids:
        print(
            f"note: {prompt_ids.count(unknown)} of the prompt's {len(prompt_ids)} tokens are words the tokenizer "
            f"does not know (read as {tokenizer.unk_token!r}): write the prompt in the model's vocabulary.",
            file=sys.stderr)


def prompt_echo_streamer(tokenizer, prompt: str):
    """A `TextStreamer` that prints `prompt` as the user gave it (special tokens such as `<bos>` included), then the
    continuation without special tokens, spaced as the tokenizer decodes prompt + continuation."""
    from transformers import TextStreamer

    class PromptEchoStreamer(TextStreamer):
        def put(self, value):
            if self.next_tokens_are_prompt:
                self.next_tokens_are_prompt = False
                ids = (value[0] if value.ndim > 1 else value).tolist()
                print(prompt, end="", flush=True)
                # The continuation is what decoding prompt + new tokens adds after the decoded prompt.
                self.token_cache = ids
                self.print_len = len(self.tokenizer.decode(ids, **self.decode_kwargs))
                return
            super().put(value)

    return PromptEchoStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)


def resolve_device(name: str | None) -> str:
    """`--device`, checked: a device torch knows and this machine has (default: cuda when available, else cpu)."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.split(":")[0] == "meta":
        raise UsageError("--device meta holds no data and cannot generate: use --device cpu or cuda.")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise UsageError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps).") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available on this machine; use --device cpu.")
    return name


def load_tokenizer(name: str, trust_remote_code: bool, *, explicit: bool):
    """The tokenizer of `name`, or a one-line error that says to pass `--tokenizer`."""
    from transformers import AutoTokenizer

    folder = Path(name)
    if not explicit and folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{name!r} holds no tokenizer (none of {list(TOKENIZER_FILES)}): pass "
                                "--tokenizer PATH_OR_ID, e.g. --tokenizer gpt2 for the released models.")
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as error:
        # A folder without tokenizer files makes transformers fall back to sentencepiece/tiktoken conversions,
        # whose messages talk about packages instead of the missing files.
        hint = "" if explicit else " (pass --tokenizer PATH_OR_ID to use another one, e.g. --tokenizer gpt2)"
        raise FileNotFoundError(f"cannot load a tokenizer from {name!r}{hint}: {one_line(error)}") from error
