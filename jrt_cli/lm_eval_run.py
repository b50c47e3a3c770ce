"""`jrt lm-eval ...`: lm-evaluation-harness's own command line, with jrt-rnn's model and recall tasks registered.

Everything after `lm-eval` is lm-eval's (`lm-eval run --help`). This front end only

- imports `jrt_eval.lm`, which registers the model `jrt` (`JRTLM`: leak-free JRT prefix scoring),
- uses `--model jrt` when no `--model` is given (any other lm-eval model still works),
- adds `jrt_eval.TASKS_DIR` (the recall tasks `jrt_swde`, `jrt_swde_twice`, ...) to `--include_path`,

then hands over to lm-eval (`lm_eval._cli.HarnessCLI`), which parses, evaluates and writes results as usual.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import functools
import gzip
import importlib.util
import json
import math
import sys
from pathlib import Path

from .choices import PREFIX_STRATEGIES
from .main import UsageError, quiet_transformers, require_lm_eval
from .sources import check_model_source, go_offline, hub_unreachable

LM_EVAL_SUBCOMMANDS: tuple[str, ...] = ("run", "ls", "validate")

# The `--model_args` keys the `jrt` model takes, known without importing torch (an unknown one is a usage error before
# anything loads):
# - lm-eval's HF model's own arguments (`HFLM.__init__`; a test holds this list against the installed lm-eval),
HFLM_ARGUMENTS: tuple[str, ...] = (
    "pretrained", "backend", "revision", "subfolder", "tokenizer", "truncation", "logits_cache", "max_length",
    "device", "dtype", "softmax_dtype", "mixed_precision_dtype", "batch_size", "max_batch_size", "trust_remote_code",
    "use_fast_tokenizer", "add_bos_token", "prefix_token_id", "parallelize", "max_memory_per_gpu", "max_cpu_memory",
    "offload_folder", "tp_plan", "peft", "delta", "autogptq", "gptqmodel", "gguf_file", "think_end_token",
    "enable_thinking", "chat_template_args",
)
# - the `jrt` model's own (`jrt_eval.lm.JRTLM`),
JRT_MODEL_ARGUMENTS: tuple[str, ...] = ("scoring", "prefix_strategy")
# - what HFLM passes on to `from_pretrained`: transformers' loading options (the model's config fields are the rest).
FROM_PRETRAINED_OPTIONS: tuple[str, ...] = (
    "attn_implementation", "device_map", "low_cpu_mem_usage", "quantization_config", "torch_dtype", "cache_dir",
    "force_download", "local_files_only", "token", "use_safetensors", "variant", "key_mapping", "max_memory",
    "offload_state_dict", "offload_buffers", "use_kernels", "kernel_config", "experts_implementation",
    "distributed_config", "device_mesh", "tp_size", "weights_only", "adapter_name", "adapter_kwargs", "gpus",
    "load_in_8bit", "load_in_4bit", "bnb_4bit_compute_dtype", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
    "output_loading_info", "proxies",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lm-eval", add_help=False, description=__doc__,
        help="lm-evaluation-harness with the `jrt` model and the recall tasks (arguments: lm-eval's)",
    )
    parser.set_defaults(func=run, passthrough=True)


def lm_eval_argv(extra: list[str]) -> list[str]:
    """The lm-eval argument list for `jrt lm-eval EXTRA`: `run` and `--model jrt` added when absent."""
    argv = list(extra)
    if not argv or argv[0] not in LM_EVAL_SUBCOMMANDS:
        argv.insert(0, "run")
    if argv[0] == "run" and not any(arg in ("--model", "-M") or arg.startswith("--model=") for arg in argv):
        if not any(arg in ("-h", "--help") for arg in argv):
            argv[1:1] = ["--model", "jrt"]
    return argv


def build_lm_eval_cli():
    """lm-eval's `HarnessCLI` with `run --model` documented as defaulting to `jrt` (lm-eval's own says `hf`). Only
    lm-eval's argument parser is imported here: `--help` and usage errors never load torch."""
    from lm_eval._cli import HarnessCLI

    cli = HarnessCLI()
    run_parser = cli._subparsers.choices["run"]
    for action in run_parser._actions:
        if "--model" in action.option_strings:
            action.default = "jrt"
            action.help = "Model name (default: jrt, jrt-rnn's leak-free JRT model; any lm-eval model works)"
    return cli


def run(args: argparse.Namespace) -> int:
    require_lm_eval("`jrt lm-eval` needs")
    cli = build_lm_eval_cli()
    saved_argv = sys.argv
    sys.argv = ["jrt lm-eval", *lm_eval_argv(args.extra)]
    try:
        lm_eval_args = cli.parse_args()  # exits for --help (code 0) and for lm-eval's own usage errors (code 2)
    finally:
        sys.argv = saved_argv
    check_arguments_early(lm_eval_args)
    if getattr(lm_eval_args, "model", None) == "jrt":  # before the seconds of importing torch and transformers
        for key in ("pretrained", "tokenizer"):
            name = (lm_eval_args.model_args or {}).get(key)
            if isinstance(name, str):
                check_model_source(name, f"--model_args {key}")
    from lm_eval.utils import setup_logging

    from jrt_eval import TASKS_DIR

    setup_logging()
    check_run_arguments(lm_eval_args)  # lm-eval's task index: still before torch
    if hasattr(lm_eval_args, "include_path"):
        user_path = lm_eval_args.include_path
        lm_eval_args.include_path = [str(TASKS_DIR)] + ([user_path] if user_path else [])
    import jrt_eval.lm  # noqa: F401  (registers the lm-eval model "jrt"; imports torch and transformers)

    quiet_transformers()
    offline_when_the_hub_is_unreachable(lm_eval_args)
    cli.execute(lm_eval_args)
    return 0


def offline_when_the_hub_is_unreachable(lm_eval_args: argparse.Namespace) -> None:
    """When the Hub (where the tasks' data sets come from) cannot be reached, read the local cache only, at once,
    instead of through a minute of retries per file, and say so."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or not getattr(lm_eval_args, "tasks", None):
        return
    problem = hub_unreachable()
    if problem is None:
        return
    go_offline()
    import datasets.config

    datasets.config.HF_HUB_OFFLINE = True  # read once at import: tell the data set loader too
    print(
        f"note: the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached ({problem}): data sets are read from "
        "the local cache only (as with HF_HUB_OFFLINE=1).",
        file=sys.stderr,
    )


def check_run_arguments(lm_eval_args: argparse.Namespace) -> None:
    """Unknown task names, a usage error found before torch is imported (lm-eval finds them only after loading the
    model and the data sets), from the task index jrt-rnn ships for its pinned lm-eval (`shipped_task_index`), else
    (another release, or `--include_path`) from the one lm-eval builds (about 15 s)."""
    tasks = getattr(lm_eval_args, "tasks", None)
    if getattr(lm_eval_args, "command", None) != "run" or not tasks:
        return
    names = _task_names(tasks)
    user_path = getattr(lm_eval_args, "include_path", None)
    index = None if user_path else shipped_task_index()
    if index is not None:  # the installed lm-eval's names, read from the index jrt-rnn ships for it (ms)
        known = index + shipped_task_names()
        unknown = [name for name in names if not _matches(name, known)]
    else:
        from lm_eval.tasks import TaskManager

        from jrt_eval import TASKS_DIR

        manager = TaskManager(include_path=[str(TASKS_DIR)] + ([user_path] if user_path else []))
        unknown = [name for name in names if not Path(name).exists() and not manager.match_tasks([name])]
    if unknown:
        raise UsageError(f"unknown task(s) {', '.join(unknown)}: `jrt lm-eval ls tasks` lists them "
                         "(jrt-rnn's recall tasks are jrt_swde, jrt_fda, ..., see docs/evaluation.md).")


def check_arguments_early(lm_eval_args: argparse.Namespace) -> None:
    """Usage errors found from the arguments alone, before torch, transformers and lm-eval's models are imported:
    `--model jrt` without `pretrained=` in `--model_args`, an empty `--tasks`, a `jrt_*` task that jrt-rnn does not
    ship, `--limit` <= 0, a `--batch_size` that is not one, and for the `jrt` model a `--model_args` key it does not
    take and a `scoring=` / `prefix_strategy=` it does not know. Other task names need lm-eval's task index:
    `check_run_arguments`."""
    if getattr(lm_eval_args, "command", None) != "run":
        return
    is_jrt = getattr(lm_eval_args, "model", None) == "jrt"
    model_args = (lm_eval_args.model_args or {}) if is_jrt else {}
    if is_jrt and (not isinstance(model_args, dict) or not model_args.get("pretrained")):
        raise UsageError("the `jrt` model needs the checkpoint: --model_args pretrained=PATH_OR_HUB_ID[,key=value ...] "
                         f"(got {model_args or 'none'!r}).")
    tasks = getattr(lm_eval_args, "tasks", None)
    if tasks is not None:
        names = _task_names(tasks)
        if not names:
            raise UsageError(f"--tasks {','.join(tasks) if isinstance(tasks, list) else tasks!r} "
                             "names no task: give one or more task names, e.g. --tasks jrt_swde "
                             "or --tasks jrt_swde,hellaswag (`jrt lm-eval ls tasks` lists them).")
        shipped = shipped_task_names()
        # With the user's own tasks (--include_path), a jrt_* name may be theirs: lm-eval's index decides.
        own_tasks = bool(getattr(lm_eval_args, "include_path", None))
        unknown = [name for name in names if name.startswith("jrt_") and not _matches(name, shipped)]
        if unknown and not own_tasks:
            hints = {name: difflib.get_close_matches(name, shipped, n=1) for name in unknown}
            hint = "".join(f" ({name}: did you mean {match[0]}?)" for name, match in hints.items() if match)
            raise UsageError(f"unknown task(s) {', '.join(unknown)}{hint}: jrt-rnn's tasks "
                             f"are {', '.join(sorted(shipped))} (docs/evaluation.md).")
    limit = getattr(lm_eval_args, "limit", None)
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise UsageError(f"--limit {limit:g}: expected a number of examples per "
                         "task (>= 1) or a fraction of them (between 0 and 1).")
    batch_size = getattr(lm_eval_args, "batch_size", None)
    if batch_size is not None and not _is_batch_size(str(batch_size)):
        raise UsageError(f"--batch_size {batch_size}: expected a positive integer, 'auto' or 'auto:N'.")
    if is_jrt:
        from jrt_eval import SCORING_MODES

        for key, allowed in (("scoring", SCORING_MODES), ("prefix_strategy", PREFIX_STRATEGIES)):
            if key in model_args and model_args[key] not in allowed:
                raise UsageError(f"--model_args {key}={model_args[key]} is not one "
                                 f"of {', '.join(allowed)} (the `jrt` model's).")
        check_model_arg_names(model_args)


def check_model_arg_names(model_args: dict) -> None:
    """Refuse a `--model_args` key that the `jrt` model does not take: not an argument of lm-eval's HF model or of
    `jrt`, not a `from_pretrained` option and not a field of the model's config (its class found from the model_type
    of the folder's config.json, or the Hub cache's; without either, the loader decides later)."""
    config = _saved_config(model_args.get("pretrained"))
    fields = config_fields(config.get("model_type")) if config is not None else None
    if fields is None:  # no config at hand, or a model type whose config class is not found: the loader decides
        return
    known = {*HFLM_ARGUMENTS, *JRT_MODEL_ARGUMENTS, *FROM_PRETRAINED_OPTIONS, *fields, *config}
    for key, value in model_args.items():
        if key in known:
            continue
        match = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f" (did you mean {match[0]}?)" if match else ""
        raise UsageError(f"--model_args {key}={value}: the `jrt` model takes no argument "
                         f"{key!r}{hint}. It takes lm-eval's HF model arguments (dtype, device, "
                         "max_length, ...), scoring and prefix_strategy, from_pretrained "
                         "options and the model's config fields (docs/evaluation.md).")


def task_index_path(version: str) -> Path:
    return Path(__file__).resolve().parent / "assets" / f"lm_eval_tasks-{version}.txt.gz"


@functools.cache
def shipped_task_index() -> tuple[str, ...] | None:
    """The task, group and tag names of the installed lm-eval (`TaskManager().all_tasks`), from the index jrt-rnn
    ships for its release (`write_task_index`), or None for a release without one (or no lm-eval)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        path = task_index_path(version("lm_eval"))
    except PackageNotFoundError:
        return None
    if not path.is_file():
        return None
    with gzip.open(path, "rt", encoding="utf-8") as file:
        return tuple(line for line in file.read().splitlines() if line)


def write_task_index() -> Path:
    """Write the installed lm-eval's task index (`TaskManager().all_tasks`, sorted, one a line, gzip without a time
    stamp) where `shipped_task_index` reads it: run after changing the lm-eval release pinned in pyproject."""
    from importlib.metadata import version

    from lm_eval.tasks import TaskManager

    path = task_index_path(version("lm_eval"))
    text = "".join(f"{name}\n" for name in sorted(set(TaskManager().all_tasks)))
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as file:
        file.write(text.encode("utf-8"))
    return path


@functools.cache
def shipped_task_names() -> tuple[str, ...]:
    """The task and group names of the YAML files jrt-rnn ships (`jrt_eval/tasks`), read without lm-eval."""
    from jrt_eval import TASKS_DIR

    names = []
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        for line in path.read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            if key in ("task", "group") and value.strip() and not value.strip().startswith(("[", "!")):
                names.append(value.strip().strip("'\""))
    return tuple(dict.fromkeys(names))


@functools.cache
def config_fields(model_type: str | None) -> frozenset[str] | None:
    """The fields a config of `model_type` accepts as `from_pretrained` overrides, read from the source of its config
    class (`JRTRNNConfig` for "jrt_rnn", else transformers' `models/<type>/configuration_<type>.py`) and of
    transformers' `PreTrainedConfig`, without importing them (that imports torch): their annotated attributes,
    `__init__` arguments, settable properties and `attribute_map` aliases. None when the source is not found."""
    if not isinstance(model_type, str) or not model_type.replace("-", "_").isidentifier():
        return None
    module = model_type.replace("-", "_")
    own = "modeling_jrt", "configuration_jrt.py"
    if model_type != "jrt_rnn":
        own = "transformers", f"models/{module}/configuration_{module}.py"
    trees = [_parsed_source(*own), _parsed_source("transformers", "configuration_utils.py")]
    if any(tree is None for tree in trees):
        return None
    fields: set[str] = set()
    for tree, classes in zip(trees, (None, ("PreTrainedConfig", "PretrainedConfig"))):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (node.name.endswith("Config") if classes is None
                                                   else node.name in classes):
                fields |= _class_fields(node)
    return frozenset(fields)


def _parsed_source(package: str, file_name: str) -> ast.Module | None:
    """The syntax tree of a file of an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    try:
        return ast.parse((Path(spec.origin).parent / file_name).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _class_fields(node: ast.ClassDef) -> set[str]:
    fields = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if "ClassVar" not in ast.unparse(item.annotation):
                fields.add(item.target.id)
        elif isinstance(item, ast.FunctionDef) and item.name == "__init__":
            fields |= {arg.arg for arg in [*item.args.args, *item.args.kwonlyargs] if arg.arg != "self"}
        elif isinstance(item, ast.FunctionDef) and any(
            isinstance(decorator, ast.Attribute) and decorator.attr == "setter" for decorator in item.decorator_list
        ):
            fields.add(item.name)  # a property that can be set (`output_attentions`)
        elif isinstance(item, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "attribute_map" for target in item.targets
        ) and isinstance(item.value, ast.Dict):
            fields |= {key.value for key in item.value.keys if isinstance(key, ast.Constant)}
    return fields


def _saved_config(pretrained: object) -> dict | None:
    """The config.json of `pretrained` (a local folder, or a Hub id in the local Hub cache), or None."""
    if not isinstance(pretrained, str):
        return None
    path = Path(pretrained).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(pretrained, "config.json")
        except Exception:  # noqa: BLE001  (not a valid repo id: the model source check reports it)
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _task_names(tasks: str | list[str]) -> list[str]:
    """The task names of `--tasks` (lm-eval splits its values at commas; blank names are none)."""
    return [name.strip() for name in (tasks.split(",") if isinstance(tasks, str) else tasks) if name.strip()]


def _matches(name: str, shipped: tuple[str, ...]) -> bool:
    """A shipped name, a glob over them (`jrt_nq_*`), or a task file given by path."""
    return name in shipped or any(fnmatch.fnmatchcase(task, name) for task in shipped) or Path(name).exists()


def _is_batch_size(text: str) -> bool:
    number = text.removeprefix("auto:")
    return text == "auto" or (number.isdigit() and int(number) > 0)
