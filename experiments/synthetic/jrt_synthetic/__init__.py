"""Synthetic recall experiments with tiny JRT-RNN / Based models (docs/synthetics.md): data generators, training,
experiments E1/E2, reports and the command line. A research harness, not part of the installed package: it uses
`modeling_jrt` and `jrt_cli` like any other client. Importable without matplotlib."""

from .cli import build_parser, main
from .data import (IGNORE_INDEX, SyntheticBatch, multiquery_ar, prefix_query_mqar, render_tokens, sd_token_map,
                   set_disjointness)
from .train import RunSpec, TaskSpec, evaluate, recurrent_state_size, train_run

__all__ = ["IGNORE_INDEX", "RunSpec", "SyntheticBatch", "TaskSpec", "build_parser", "evaluate", "main",
           "multiquery_ar", "prefix_query_mqar", "recurrent_state_size", "render_tokens", "sd_token_map",
           "set_disjointness", "train_run"]
