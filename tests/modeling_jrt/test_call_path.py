"""The path from `generate()` to the linear-attention scan: few of our frames, and the op's inputs checked once."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from modeling_jrt import JRTRNNForCausalLM
from modeling_jrt import linear_attention

PACKAGE = Path(linear_attention.__file__).resolve().parent
MAX_PROJECT_FRAMES = 6  # causal LM, backbone, blocks, layer, mixer, op


@pytest.mark.parametrize("linear_attention_type", ["prefix", "causal"])
def test_generate_reaches_the_scan_through_six_frames_and_one_check(monkeypatch, make_config, linear_attention_type):
    config = make_config(
        num_hidden_layers=2, mixer_types=["conv", "linear_attention"], linear_attention_type=linear_attention_type
    )
    model = JRTRNNForCausalLM(config).eval()
    stacks: list[list[traceback.FrameSummary]] = []
    checks: list[int] = []
    scan, check = linear_attention.chunked_prefill, linear_attention.validate_linear_attention_inputs

    def spy_scan(*args, **kwargs):
        stacks.append(traceback.extract_stack()[:-1])
        return scan(*args, **kwargs)

    def spy_check(*args, **kwargs):
        checks.append(len(stacks))
        return check(*args, **kwargs)

    monkeypatch.setattr(linear_attention, "chunked_prefill", spy_scan)
    monkeypatch.setattr(linear_attention, "validate_linear_attention_inputs", spy_check)
    model.generate(torch.randint(4, 99, (1, 7)), max_new_tokens=1, do_sample=False)
    (stack,) = stacks  # one prefill, one linear-attention layer
    ours = [frame for frame in stack if Path(frame.filename).resolve().parent == PACKAGE]
    assert len(ours) <= MAX_PROJECT_FRAMES, [f"{Path(f.filename).name}:{f.name}" for f in ours]
    assert ours[-1].name == "prefix_linear_attention"  # the op entry calls the scan itself
    assert checks == [0]  # validated once, by the op entry, before the scan
