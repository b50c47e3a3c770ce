"""PEFT's prompt-learning methods: prompt tuning trains (virtual token embeddings ahead of the input), prefix tuning
is refused with a clear error (it injects attention key/value prefixes, which recurrent layers have no use for)."""

from __future__ import annotations

import pytest
import torch

from modeling_jrt import JRTRNNForCausalLM
from modeling_jrt import JRTRNNCache


@pytest.mark.parametrize("linear_attention_type", ["prefix", "causal"])
def test_prompt_tuning_trains_the_virtual_tokens_only(make_config, linear_attention_type):
    from peft import PromptTuningConfig, get_peft_model

    base = JRTRNNForCausalLM(make_config(linear_attention_type=linear_attention_type))
    frozen = {name: p.detach().clone() for name, p in base.named_parameters()}
    model = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["prompt_encoder.default.embedding.weight"]
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.3)
    input_ids = torch.randint(4, 99, (2, 12), generator=torch.Generator().manual_seed(0))

    losses = []
    for _ in range(20):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        gradient = model.prompt_encoder["default"].embedding.weight.grad
        assert gradient is not None and gradient.abs().sum() > 0  # the prompt receives a gradient through every layer
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.01  # a random tiny model reacts weakly to its input, but it does learn
    for name, p in base.named_parameters():
        assert torch.equal(p, frozen[name]), name  # only the virtual tokens moved


def test_prefix_tuning_is_refused_with_the_alternatives(make_config):
    from peft import PrefixTuningConfig, get_peft_model

    model = get_peft_model(JRTRNNForCausalLM(make_config()), PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                                num_virtual_tokens=4))
    input_ids = torch.randint(4, 99, (2, 8))
    with pytest.raises(ValueError, match=r"PEFT prefix tuning \(`PrefixTuningConfig`\).*prompt tuning"):
        model(input_ids=input_ids, labels=input_ids)


def test_a_cache_of_another_kind_is_refused(make_config):
    from transformers import DynamicCache

    model = JRTRNNForCausalLM(make_config())
    input_ids = torch.randint(4, 99, (1, 6))
    with pytest.raises(ValueError, match=r"The cache is a DynamicCache.*`JRTRNNCache\(model.config\)`"):
        model(input_ids=input_ids, cache=DynamicCache())
    with pytest.raises(ValueError, match=r"built for mixer_types=\['conv', 'linear_attention'\]"):
        model(input_ids=input_ids, cache=JRTRNNCache(make_config(num_hidden_layers=2,
                                                                 mixer_types=["conv", "linear_attention"])))
    # Every field that fixes the cache's shapes is checked, named in the error (a wider window used to run silently).
    window = model.config.sliding_window + 2
    with pytest.raises(ValueError, match=rf"built for sliding_window={window}, but this model has sliding_window="):
        model(input_ids=input_ids, cache=JRTRNNCache(make_config(sliding_window=window)))
    with pytest.raises(ValueError, match=r"built for hidden_size="):
        model(input_ids=input_ids, cache=JRTRNNCache(make_config(hidden_size=2 * model.config.hidden_size)))
    # A cache built from the config is accepted (and is what the model builds itself).
    model(input_ids=input_ids, cache=JRTRNNCache(model.config))
