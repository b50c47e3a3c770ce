"""The cross-release set: folders saved on the newest transformers load as the same model on this release.

Each folder of `folders.py` is loaded with `trust_remote_code=True` alone, in an interpreter where this distribution's
packages cannot be imported (`isolated_checks.py`), and must give what the package computed when it saved the folder:
the same mixers and weights (nothing missing, nothing unexpected), fp32 logits within 1e-5, the same greedy tokens of
a left-padded batch, a second turn from the returned cache equal to a one-shot run (under `cache=` and under
`past_key_values=`), a stale cache refused, assisted decoding refused with a `ValueError`, beam search, `pipeline`
(folders with a tokenizer), and a 0.2 folder's `prefix_strategy` migrated with a warning.

`JRT_CROSS_RELEASE_FOLDER=DIR` names folders saved on another release (`.ci/run` saves them with the newest release
and runs this file on every release of its matrix); without it, the folders are saved here first, on this release.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from isolated_python import BLOCK_LOCAL_PACKAGES

HERE = Path(__file__).resolve().parent
FOLDERS = ("jrt-demo", "based-demo", "based-decay", "jrt-sliding", "converted", "legacy-0.3")
CACHE_NAMES = ("cache", "past_key_values")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """What `isolated_checks.py` recorded for every folder, with each folder's `expected.pt`."""
    tmp = tmp_path_factory.mktemp("cross_release")
    source = os.environ.get("JRT_CROSS_RELEASE_FOLDER")
    root = tmp / "folders"
    if source:
        shutil.copytree(source, root)
    else:
        sys.path.insert(0, str(HERE))
        try:
            from folders import save_folders
        finally:
            sys.path.remove(str(HERE))
        save_folders(root, tmp / "scratch")
    script = tmp / "checks.py"
    script.write_text(BLOCK_LOCAL_PACKAGES + (HERE / "isolated_checks.py").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp / "modules"), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    out = tmp / "results.pt"
    process = subprocess.run(
        [sys.executable, "-I", str(script), str(out), *(str(root / name) for name in FOLDERS)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=900,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    recorded = torch.load(out)
    return {name: (recorded[str(root / name)], torch.load(root / name / "expected.pt")) for name in FOLDERS} | {
        "transformers": recorded["transformers"]
    }


def folder_results(results: dict, name: str) -> tuple[dict, dict]:
    record, expected = results[name]
    assert "failed" not in record, f"{name} failed on transformers {results['transformers']}:\n{record['failed']}"
    return record, expected


@pytest.mark.parametrize("name", FOLDERS)
def test_the_same_model_loads(results, name):
    record, expected = folder_results(results, name)
    assert record["module"].startswith("transformers_modules."), record["module"]
    assert record["mixer_types"] == expected["mixer_types"]
    assert not record["config_has_layer_types"], "transformers would read the mixers as its own layer types"
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not record["loading_info"].get(kind), (kind, record["loading_info"][kind])
    torch.testing.assert_close(record["logits"], expected["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FOLDERS)
def test_batched_left_padded_greedy_tokens_are_equal(results, name):
    record, expected = folder_results(results, name)
    assert torch.equal(record["generated"], expected["generated"]), (record["generated"], expected["generated"])


@pytest.mark.parametrize("cache_name", CACHE_NAMES)
@pytest.mark.parametrize("name", FOLDERS)
def test_a_second_turn_from_the_cache_equals_a_one_shot_run(results, name, cache_name):
    record, expected = folder_results(results, name)
    second = record[f"two_turns[{cache_name}]"]
    assert isinstance(second, torch.Tensor), second
    assert torch.equal(second, expected["two_turns"]), (second, expected["two_turns"])


@pytest.mark.parametrize("cache_name", CACHE_NAMES)
@pytest.mark.parametrize("name", FOLDERS)
def test_a_stale_cache_is_refused(results, name, cache_name):
    record, _ = folder_results(results, name)
    for kind in (f"stale[{cache_name}]", f"stale_unpadded[{cache_name}]"):
        assert record[kind] is not None, f"{kind}: a cache that read more tokens than the input was accepted"
        assert record[kind].startswith("ValueError: This cache has read"), (kind, record[kind])


@pytest.mark.parametrize("name", FOLDERS)
def test_assisted_decoding_is_refused_with_a_value_error(results, name):
    record, _ = folder_results(results, name)
    for kind in ("prompt_lookup", "assistant_model"):
        assert record[kind] is not None and record[kind].startswith("ValueError"), (kind, record[kind])


@pytest.mark.parametrize("name", FOLDERS)
def test_beam_search_runs(results, name):
    record, expected = folder_results(results, name)
    assert record["beam_search_shape"] == (2, expected["input_ids"].shape[1] + 3)


@pytest.mark.parametrize("name", ["jrt-demo", "based-demo"])
def test_pipeline_generates_what_generate_does(results, name):
    record, _ = folder_results(results, name)
    # Word tokens: releases differ in the space they put before the first generated word.
    assert [text.strip() for text in record["pipeline"]] == [text.strip() for text in record["pipeline_expected"]]
    assert all(text.strip() for text in record["pipeline"]), record["pipeline"]


def test_a_legacy_prefix_strategy_is_migrated_with_a_warning(results):
    record, expected = folder_results(results, "legacy-0.3")
    assert record["prefix_strategy"] == "repeat"
    assert any("prefix_strategy" in message for message in record["load_warnings"]), record["load_warnings"]
