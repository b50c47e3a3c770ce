"""The prefix rule has one implementation (`prefix_fill.plan_prefix`): the fill, the encoder range, the labels rule
and the chunked prefill read the same per-row plan, and every argument that sets a prefix (`prefix_length=`,
`prompt_lengths=`, int or per row) is checked by one rule with one message."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

import modeling_jrt.labels
import modeling_jrt.modeling_jrt
from modeling_jrt import JRTRNNForCausalLM
from modeling_jrt.prefix_fill import plan_prefix


def left_padded() -> torch.Tensor:
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :7] = 0  # 3 tokens
    mask[1, :2] = 0  # 8 tokens
    return mask  # row 2: 10 tokens


@pytest.mark.parametrize("strategy, fill", [("pad", [5, 0, 0]), ("repeat", [5, 0, 0]), ("none", [0, 0, 0])])
def test_the_plan_of_a_left_padded_batch(strategy, fill):
    plan = plan_prefix(tiny_config(), left_padded(), 3, 10, torch.device("cpu"), prefix_length=8, strategy=strategy)
    assert plan.start.tolist() == [7, 2, 0] and plan.tokens.tolist() == [3, 8, 10]
    assert plan.encoder_tokens.tolist() == [3, 8, 8] and plan.fill.tolist() == fill
    assert plan.encoder_end.tolist() == [10, 10, 8]
    # In the model's layout (F = max(fill - start) columns in front), each row's encoder reads its fill and prompt.
    columns = max(max(f - s, 0) for f, s in zip(fill, [7, 2, 0]))
    assert plan.fill_columns == columns
    assert plan.read_start.tolist() == [s + columns - f for s, f in zip([7, 2, 0], fill)]
    assert plan.prefix_lengths.tolist() == [f + e for f, e in zip(fill, [3, 8, 8])]
    assert plan.read_width == int(plan.read_end.max())
    # The cache keeps the plan: beam search selects its rows, the columns stay.
    picked = plan.select_rows(torch.tensor([2, 0]))
    assert picked.start.tolist() == [0, 7] and picked.read_end.tolist() == [plan.read_end[2], plan.read_end[0]]
    assert picked.fill_columns == plan.fill_columns and picked.strategy == strategy


def test_prompt_lengths_end_the_encoder_read_before_the_first_target():
    plan = plan_prefix(tiny_config(), left_padded(), 3, 10, torch.device("cpu"), prefix_length=8,
                       prompt_lengths=torch.tensor([2, 5, 9]))
    assert plan.encoder_tokens.tolist() == [2, 5, 8]
    assert plan.encoder_end.tolist() == [9, 7, 8]  # the label index where each row's encoder read ends
    # an int prompt length is the same for every row
    same = plan_prefix(tiny_config(), left_padded(), 3, 10, torch.device("cpu"), prefix_length=8, prompt_lengths=4)
    assert same.encoder_tokens.tolist() == [3, 4, 4]


@pytest.mark.parametrize(
    "name, value, error, message",
    [
        ("prompt_lengths", torch.tensor([1.5, 3.0, 4.0]), ValueError,
         r"^prompt_lengths must be an int or a \(B,\) = \(3,\) integer tensor of per-row lengths; got a torch.float32"),
        ("prompt_lengths", torch.tensor([[1, 2, 3]]), ValueError, r"^prompt_lengths must be an int or a \(B,\) = \(3,\)"),
        ("prompt_lengths", torch.tensor([1, 2]), ValueError, r"^prompt_lengths must be an int or a \(B,\) = \(3,\)"),
        ("prompt_lengths", [1, 2, 3], TypeError, r"^prompt_lengths must be an int or a \(B,\) LongTensor; got list\.$"),
        ("prompt_lengths", torch.tensor([-1, 8, 8]), ValueError, r"^prompt_lengths must be >= 0 in every row; got \[-1"),
        ("prefix_length", torch.tensor([-1, 8, 8]), ValueError, r"^prefix_length must be >= 0 in every row; got \[-1"),
        ("prefix_length", 2**22, ValueError, r"^prefix_length must be at most 1,048,576 \(the config's bound\); got"),
        ("prefix_length", 2**40, ValueError, r"^prefix_length must be at most 1,048,576"),
        ("prefix_length", torch.tensor([4, 2**30, 4]), ValueError, r"^prefix_length must be at most 1,048,576 in every"),
    ],
)
def test_every_argument_that_sets_a_prefix_follows_one_rule(name, value, error, message):
    model = JRTRNNForCausalLM(tiny_config()).eval()
    input_ids = torch.randint(4, 99, (3, 10))
    with pytest.raises(error, match=message), torch.no_grad():
        model(input_ids, **{name: value})


def test_an_int_prompt_length_equals_the_per_row_tensor():
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(initializer_range=0.3)).eval()
    input_ids = torch.randint(4, 99, (2, 10))
    with torch.no_grad():
        as_int = model(input_ids, prompt_lengths=3).logits
        as_rows = model(input_ids, prompt_lengths=torch.tensor([3, 3])).logits
        whole = model(input_ids).logits
    torch.testing.assert_close(as_int, as_rows, rtol=0, atol=0)
    assert not torch.allclose(as_int, whole)


def test_the_forward_masks_labels_by_the_same_plan_without_the_labels_hook():
    """With the labels rule's hook removed, the forward plans the targets the encoder reads itself, from the
    arguments it was given: the same loss, also with a fill token passed to the call only."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(prefix_pad_token_id=None, prefix_strategy="pad")).train()
    input_ids = torch.randint(4, 99, (2, 10))
    labels = input_ids.clone()
    labels[:, :3] = -100  # completion-only: 3-token prompts, filled to the prefix of 8 with the call's token
    hooked = model(input_ids, labels=labels, prefix_pad_token_id=3).loss
    model.leak_free_labels_hook.remove()
    alone = model(input_ids, labels=labels, prefix_pad_token_id=3).loss
    assert hooked > 0
    torch.testing.assert_close(alone, hooked, rtol=0, atol=0)


def test_a_callers_plan_rules_the_labels_with_or_without_the_hook():
    """A plan the caller made (`prefix_plan=`) with `labels`: the hook keeps it (it used to plan its own from the
    labels and drop the caller's), and the forward called without the hook masks the targets its encoder reads (it
    used to score them). Both give the loss of the same prefix asked for by its arguments."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(initializer_range=0.3)).train()
    input_ids = torch.randint(4, 99, (2, 10))
    prompt_lengths = torch.tensor([5, 2])  # encoder reads of 5 and 2 tokens; labels alone would give 8 each
    plan = plan_prefix(model.config, None, 2, 10, input_ids.device, prompt_lengths=prompt_lengths)
    expected = model(input_ids, labels=input_ids, prompt_lengths=prompt_lengths).loss
    hooked = model(input_ids, labels=input_ids, prefix_plan=plan).loss
    alone = model.forward(input_ids, labels=input_ids, prefix_plan=plan).loss
    assert not torch.allclose(expected, model(input_ids, labels=input_ids).loss)  # the plan matters
    torch.testing.assert_close(hooked, expected, rtol=0, atol=0)
    torch.testing.assert_close(alone, expected, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_plan_for_another_batch_is_refused_by_name(rows):
    """A caller's `prefix_plan` made for another batch size: one message that says so and how to make it, with or
    without labels, through the hook or not (a plan of 2 rows used to fail the labels' mask with torch's broadcast
    message)."""
    model = JRTRNNForCausalLM(tiny_config()).train()
    input_ids = torch.randint(4, 99, (3, 10))
    plan = plan_prefix(model.config, None, rows, 10, input_ids.device)
    for call in (model, model.forward):
        for labels in (None, input_ids):
            with pytest.raises(ValueError, match=rf"prefix_plan was made for {rows} rows; this batch has 3: make it"):
                call(input_ids, labels=labels, prefix_plan=plan)


def test_a_training_step_plans_its_prefix_once_with_or_without_the_hook(monkeypatch):
    """The labels rule (`apply_labels_rule`) plans the prefix and the backbone lays it out by that plan: one plan per
    step, whether the hook ran (`model(...)`) or the forward was called without it (`model.forward(...)`), and the
    same loss."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return plan_prefix(*args, **kwargs)

    monkeypatch.setattr(modeling_jrt.labels, "plan_prefix", counted)
    monkeypatch.setattr(modeling_jrt.modeling_jrt, "plan_prefix", counted)
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config()).train()
    input_ids = torch.randint(4, 99, (3, 10))
    labels = input_ids.masked_fill(left_padded() == 0, -100)
    losses = []
    for call in (model, model.forward):
        calls.clear()
        losses.append(call(input_ids=input_ids, attention_mask=left_padded(), labels=labels).loss)
        assert len(calls) == 1, call
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


def test_a_positional_attention_mask_is_planned_with():
    """`model(input_ids, attention_mask, labels=...)`: the labels hook plans each row's prefix from the positional
    mask as well (a plan without it would put a left-padded row's prefix on its padding)."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(initializer_range=0.3)).train()
    input_ids = torch.randint(4, 99, (3, 10))
    labels = input_ids.masked_fill(left_padded() == 0, -100)
    by_name = model(input_ids=input_ids, attention_mask=left_padded(), labels=labels)
    by_position = model(input_ids, left_padded(), labels=labels)
    torch.testing.assert_close(by_position.logits, by_name.logits, rtol=0, atol=0)
    torch.testing.assert_close(by_position.loss, by_name.loss, rtol=0, atol=0)


def test_the_hook_and_the_forward_read_a_continued_cache_by_the_same_rule():
    """A call that continues a cache given as `past_key_values=` (with `cache=None` beside it) is not a first
    forward for the labels hook either: nothing is planned or masked, as in `forward` called without the hook."""
    import copy

    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(initializer_range=0.3)).eval()
    with torch.no_grad():
        cache = model(torch.randint(4, 99, (2, 10)), use_cache=True).past_key_values
        nxt = torch.randint(4, 99, (2, 6))
        call = dict(input_ids=nxt, labels=nxt, cache=None)
        hooked = model(**call, past_key_values=copy.deepcopy(cache)).loss
        alone = model.forward(**call, past_key_values=copy.deepcopy(cache)).loss
    torch.testing.assert_close(hooked, alone, rtol=0, atol=0)
