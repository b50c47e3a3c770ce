"""Synthetic recall experiments with tiny JRT-RNN / Based models (SYNTHETICS.md): data generators, training,
experiments E1/E2, reports and the `jrt synthetic` subcommand. Importable without matplotlib."""

from .command import add_parser
from .data import (
    IGNORE_INDEX,
    SyntheticBatch,
    multiquery_ar,
    prefix_query_mqar,
    render_tokens,
    sd_token_map,
    set_disjointness,
)
from .train import RunSpec, TaskSpec, evaluate, recurrent_state_size, train_run

__all__ = [
    "IGNORE_INDEX",
    "RunSpec",
    "SyntheticBatch",
    "TaskSpec",
    "add_parser",
    "evaluate",
    "multiquery_ar",
    "prefix_query_mqar",
    "recurrent_state_size",
    "render_tokens",
    "sd_token_map",
    "set_disjointness",
    "train_run",
]
