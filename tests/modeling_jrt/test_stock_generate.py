"""`generate()` is transformers' own: the JRT prefix is the model's first-forward concern, on public APIs only, and
the standard tools (PEFT prompt tuning, torch.compile, continuing from a forward's cache) work as a user calls them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers
from transformers.generation import GenerationMixin

import modeling_jrt
from modeling_jrt.compat import output_cache
from modeling_jrt import JRTRNNForCausalLM

PACKAGE = Path(modeling_jrt.__file__).parent
NO_EOS = dict(eos_token_id=None, pad_token_id=0)

# Underscore names transformers reads from a model class or a config: the declarations models make (allowed).
DECLARATIONS = {
    "_is_stateful", "_no_split_modules", "_tied_weights_keys", "_can_record_outputs", "_supports_sdpa",
    "_supports_flash_attn", "_can_compile_fullgraph",
    "_attn_implementation",  # the config's attention implementation, as every transformers model reads it
}


def build(make_config, **overrides) -> JRTRNNForCausalLM:
    torch.manual_seed(0)
    overrides.setdefault("initializer_range", 0.3)
    return JRTRNNForCausalLM(make_config(**overrides)).eval()


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.LongTensor:
    return torch.randint(4, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_generate_is_transformers_own():
    assert JRTRNNForCausalLM.generate is GenerationMixin.generate


def transformers_underscore_names() -> set[str]:
    """Every underscore-prefixed attribute of the transformers classes the model and its cache build on."""
    bases = [transformers.PreTrainedModel, GenerationMixin, transformers.cache_utils.Cache,
             transformers.PretrainedConfig]
    return {name for base in bases for name in dir(base) if name.startswith("_") and not name.startswith("__")}


def test_the_model_code_uses_no_private_transformers_name():
    """No override, call or read of an underscore-prefixed transformers name (the declarations excepted), no
    `__class__` assignment: the shipped code runs on every transformers release of the declared range."""
    private = transformers_underscore_names() - DECLARATIONS
    offences = []
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in private:
                offences.append(f"{path.name}:{node.lineno} defines {node.name}")
            elif isinstance(node, ast.Attribute) and node.attr in private:
                offences.append(f"{path.name}:{node.lineno} uses .{node.attr}")
            elif isinstance(node, ast.Attribute) and node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                offences.append(f"{path.name}:{node.lineno} assigns __class__")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                offences.extend(
                    f"{path.name}:{node.lineno} imports {alias.name}" for alias in node.names if alias.name.startswith("_")
                )
    assert offences == []
    assert "_init_weights" in private  # the check sees transformers' private names (it can fail)


@pytest.mark.parametrize("linear_attention_type", ["prefix", "causal"])
def test_peft_prompt_tuning_generates(make_config, linear_attention_type):
    """PEFT prompt tuning prepends virtual token embeddings: `generate()` on the PEFT model equals the base model's
    generate from those embeddings, with a prompt shorter than the JRT prefix (the model fills it)."""
    from peft import PromptTuningConfig, get_peft_model

    base = build(make_config, linear_attention_type=linear_attention_type, prefix_length=32)
    model = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)).eval()
    input_ids = prompt(10, batch=2)
    settings = dict(max_new_tokens=5, do_sample=False, **NO_EOS)
    with torch.no_grad():
        generated = model.generate(input_ids=input_ids, **settings)
        virtual = model.get_prompt(batch_size=2)  # (2, 4, hidden)
        embeds = torch.cat([virtual, base.get_input_embeddings()(input_ids)], dim=1)
        expected = base.generate(inputs_embeds=embeds, **settings)
    assert generated.shape[0] == 2
    torch.testing.assert_close(generated[:, -5:], expected[:, -5:], rtol=0, atol=0)


def test_per_row_prefix_length_on_a_prompt_shorter_than_the_prefix(make_config):
    """`generate(prefix_length=2)` on a 1-token prompt fills it to 2 (pad + prompt, the pad masked in the linear
    attention): the encoder reads the prompt, unlike `prefix_length=0`."""
    model = build(make_config)
    short = prompt(1)
    generated = model.generate(short, prefix_length=2, max_new_tokens=6, do_sample=False, **NO_EOS)[:, 1:]
    padded = torch.cat([torch.full((1, 1), 3), short], dim=1)  # the config's prefix pad token is 3
    sequence = padded
    for _ in range(6):
        linear_mask = torch.ones_like(sequence)
        linear_mask[0, 0] = 0
        logits = model(sequence, linear_attention_mask=linear_mask, prefix_length=2, prefix_strategy="none",
                       use_cache=False).logits[:, -1]
        sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(generated, sequence[:, 2:], rtol=0, atol=0)
    no_prefix = model.generate(short, prefix_length=0, max_new_tokens=6, do_sample=False, **NO_EOS)[:, 1:]
    assert not torch.equal(generated, no_prefix)


def test_generation_errors_count_the_callers_tokens(make_config):
    """transformers' own length check sees the caller's 5 tokens (the model fills the prefix internally)."""
    model = build(make_config)
    with pytest.raises(ValueError, match="Input length of input_ids is 5"):
        model.generate(prompt(5), max_length=3, do_sample=False, **NO_EOS)


def test_a_cache_of_other_rows_is_refused(make_config):
    model = build(make_config)
    cache = model(prompt(6, batch=1), use_cache=True).cache
    with pytest.raises(ValueError, match="The cache holds 1 rows but the input has 2.*batch_repeat_interleave"):
        model(prompt(1, batch=2), cache=cache)
    cache.batch_repeat_interleave(2)
    two_rows = model(prompt(1).repeat(2, 1), cache=cache).logits
    assert two_rows.shape == (2, 1, 99)
    torch.testing.assert_close(two_rows[0], two_rows[1], rtol=0, atol=0)


def test_the_cache_pickles_and_continues(make_config):
    """What the first forward read (each row's fill and encoder range) is the cache's state: a pickled cache
    continues exactly."""
    import pickle

    model = build(make_config)
    input_ids = prompt(9, batch=2)
    with torch.no_grad():
        cache = output_cache(model(input_ids[:, :3], use_cache=True))
        restored = pickle.loads(pickle.dumps(cache))
        expected = model(input_ids[:, 3:], cache=cache).logits
        logits = model(input_ids[:, 3:], cache=restored).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert restored.fill_columns == 5 and restored.get_seq_length() == 9


@pytest.mark.slow
def test_fullgraph_compile_of_a_prefill_with_the_tokenizers_mask_and_decode_steps(make_config):
    """`torch.compile(model, fullgraph=True)`: a prefill with an all-ones mask, the default cache and the JRT fill,
    then decode steps, agree with eager."""
    model = build(make_config)
    compiled = torch.compile(model, fullgraph=True)
    input_ids = prompt(5, batch=2)
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        eager = model(input_ids, attention_mask=mask)
        traced = compiled(input_ids, attention_mask=mask)
        torch.testing.assert_close(traced.logits, eager.logits, rtol=1e-5, atol=1e-5)
        step = torch.tensor([[5], [6]])
        expected = model(step, attention_mask=torch.ones(2, 6, dtype=torch.long), cache=output_cache(eager)).logits
        logits = compiled(step, attention_mask=torch.ones(2, 6, dtype=torch.long), cache=output_cache(traced)).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("prefix_strategy", ["none", None], ids=["no-fill-fullgraph", "default-fill"])
def test_compile_of_a_training_step(make_config, prefix_strategy):
    """`torch.compile(model)` in training: the loss and every parameter's gradient agree with eager (the chunked
    linear attention is one custom op in the graph, its backward another, whose gradients have the layout the op
    declares; aot_eager: the traced graphs without inductor's C++ build). Fullgraph without the JRT fill; with the
    default fill, deriving each row's fill from `labels` breaks the graph once."""
    overrides = {} if prefix_strategy is None else dict(prefix_strategy=prefix_strategy)
    model = build(make_config, **overrides).train()
    input_ids = prompt(41, batch=2)  # not whole chunks: the scan's gradients are cut from padded chunks
    eager = model(input_ids, labels=input_ids).loss
    eager.backward()
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=prefix_strategy == "none")
    traced = compiled(input_ids, labels=input_ids).loss
    traced.backward()
    torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_continuing_from_a_beam_search_cache_is_refused(make_config):
    """Beam search leaves the beams of its last step in the cache, not the returned sequences' states."""
    from modeling_jrt.compat import output_cache

    model = build(make_config)
    out = model.generate(prompt(6), max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False,
                         return_dict_in_generate=True, **NO_EOS)
    with pytest.raises(ValueError, match="This cache comes from beam search"):
        model.generate(out.sequences, cache=output_cache(out), max_new_tokens=2, **NO_EOS)


def test_the_caches_generate_builds_are_replaced_without_a_warning(make_config, caplog):
    """The default cache and the static one (`cache_implementation="static"`) that generate() builds are replaced by
    the model's own `JRTRNNCache` without a word: the static one asks for the compiled decode path, which the model's
    fixed-shape cache takes."""
    from transformers.utils import logging as hf_logging

    recurrent = ["conv", "linear_attention", "conv", "linear_attention"]
    model = build(make_config, mixer_types=recurrent)
    hf_logging.enable_propagation()
    with caplog.at_level("WARNING"):
        model.generate(prompt(4), max_new_tokens=2, do_sample=False, **NO_EOS)
        model.generate(prompt(4), max_new_tokens=2, do_sample=False, cache_implementation="static",
                       disable_compile=True, **NO_EOS)
    assert "JRTRNNCache" not in caplog.text and "StaticCache" not in caplog.text
