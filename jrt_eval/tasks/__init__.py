"""The recall task YAMLs of `jrt_eval` (lm-eval `--include_path` folder) and the functions they name."""
