"""The functions the task YAMLs of this folder name with `!function` (lm-eval loads this file by path)."""

from jrt_eval.recall import default_prompt, first_answer, load_recall_dataset, process_results, twice_prompt

__all__ = ["default_prompt", "first_answer", "load_recall_dataset", "process_results", "twice_prompt"]
