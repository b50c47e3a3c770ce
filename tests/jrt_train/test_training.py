"""The JRT objective: collator masks, the combined loss, Trainer gradient accumulation, LoRA."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import modeling_jrt  # noqa: F401  (registers model_type "jrt_rnn" with the Auto classes)
import jrt_train
from jrt_train import JRTDataCollator, default_lora_config, ignore_prefix_targets, jrt_loss, pack_token_blocks
from modeling_jrt import JRTRNNForCausalLM

MASK_ID = 98


class BlockDataset(Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index]}


def random_blocks(num_blocks: int, seq_len: int, vocab_size: int = 98) -> torch.Tensor:
    return torch.randint(4, vocab_size, (num_blocks, seq_len))


# ---------------------------------------------------------------------------------------------------- collator


@pytest.mark.parametrize("mask_sampling", ["fixed", "bernoulli"])
def test_collator_masks_the_target_fraction_of_the_prefix_only(mask_sampling):
    prefix_length, seq_len = 200, 260
    blocks = random_blocks(64, seq_len)
    collator = JRTDataCollator(prefix_length, MASK_ID, mlm_probability=0.15, mask_sampling=mask_sampling, seed=3)
    batch = collator(list(blocks))
    masked = batch["input_ids"] == MASK_ID

    assert not masked[:, prefix_length:].any()
    fraction = masked[:, :prefix_length].float().mean().item()
    assert abs(fraction - 0.15) < 0.01
    per_sequence = masked.sum(dim=1)
    if mask_sampling == "fixed":
        assert (per_sequence == 30).all()
    else:
        assert per_sequence.unique().numel() > 1  # independent draws: counts vary


def test_collator_labels_are_aligned():
    prefix_length, seq_len = 8, 20
    blocks = random_blocks(5, seq_len)
    batch = JRTDataCollator(prefix_length, MASK_ID, mlm_probability=0.5, seed=0)([{"input_ids": b} for b in blocks])
    masked = batch["input_ids"] == MASK_ID

    # Next-token labels (HF convention, unshifted): the original tokens from position E + 1 on, -100 before.
    assert (batch["labels"][:, : prefix_length + 1] == -100).all()
    torch.testing.assert_close(batch["labels"][:, prefix_length + 1 :], blocks[:, prefix_length + 1 :])
    # Masked-LM labels: the original token at its own (masked) position, -100 elsewhere.
    torch.testing.assert_close(batch["mlm_labels"][masked], blocks[masked])
    assert (batch["mlm_labels"][~masked] == -100).all()
    # Unmasked inputs are the original tokens.
    torch.testing.assert_close(batch["input_ids"][~masked], blocks[~masked])
    prefix = batch.pop("prefix_length")
    assert prefix.dtype == torch.long and prefix.tolist() == [prefix_length] * blocks.shape[0]
    assert all(value.dtype == torch.long and value.shape == blocks.shape for value in batch.values())


def test_collator_is_deterministic_with_a_seed_and_independent_of_batching():
    blocks = list(random_blocks(8, 30))
    one_batch = JRTDataCollator(16, MASK_ID, seed=7)(blocks)
    collator = JRTDataCollator(16, MASK_ID, seed=7)
    two_batches = [collator(blocks[:3]), collator(blocks[3:])]
    for key in one_batch:
        torch.testing.assert_close(one_batch[key], torch.cat([b[key] for b in two_batches]))
    other_seed = JRTDataCollator(16, MASK_ID, seed=8)(blocks)
    assert not torch.equal(one_batch["input_ids"], other_seed["input_ids"])


def test_collator_rejects_bad_input(make_config):
    with pytest.raises(ValueError, match="prefix_length \\+ 2"):
        JRTDataCollator(8, MASK_ID)(list(random_blocks(2, 9)))
    with pytest.raises(ValueError, match="mask_sampling"):
        JRTDataCollator(8, MASK_ID, mask_sampling="poisson")
    with pytest.raises(ValueError, match="mask_token_id"):
        JRTDataCollator.from_config(make_config())
    with pytest.raises(ValueError, match="linear_attention_type"):
        JRTDataCollator.from_config(make_config(linear_attention_type="causal", mask_token_id=MASK_ID))


def test_pack_token_blocks():
    blocks = pack_token_blocks(list(range(23)), 5)
    torch.testing.assert_close(blocks, torch.arange(20).view(4, 5))
    with pytest.raises(ValueError, match="no block"):
        pack_token_blocks([1, 2], 5)


# ---------------------------------------------------------------------------------------------------- loss


def test_combined_loss_matches_a_hand_computation(make_config):
    config = make_config(mask_token_id=MASK_ID, mlm_weight=0.25)
    model = JRTRNNForCausalLM(config).eval()
    prefix_length, seq_len = config.prefix_length, 13
    blocks = random_blocks(2, seq_len)
    batch = JRTDataCollator.from_config(config, mlm_probability=0.3, seed=1)(list(blocks))
    output = model(**batch)

    log_probs = output.logits.double().log_softmax(-1)
    ntp_terms = [-log_probs[b, j - 1, blocks[b, j]] for b in range(2) for j in range(prefix_length + 1, seq_len)]
    masked = (batch["input_ids"] == MASK_ID).nonzero().tolist()
    mlm_terms = [-log_probs[b, i, blocks[b, i]] for b, i in masked]
    assert len(ntp_terms) == 2 * 4 and len(mlm_terms) == 2 * 2
    ntp, mlm = torch.stack(ntp_terms).mean(), torch.stack(mlm_terms).mean()

    torch.testing.assert_close(output.ntp_loss.double(), ntp)
    torch.testing.assert_close(output.mlm_loss.double(), mlm)
    torch.testing.assert_close(output.loss.double(), ntp + 0.25 * mlm)
    # Without mlm_labels: the plain causal-LM loss over the same labels.
    plain = model(input_ids=batch["input_ids"], labels=batch["labels"])
    torch.testing.assert_close(plain.loss.double(), ntp)
    assert plain.ntp_loss is None and plain.mlm_loss is None


def test_a_collator_with_another_prefix_length_is_refused(make_config):
    config = make_config(mask_token_id=MASK_ID)
    model = JRTRNNForCausalLM(config).eval()
    blocks = list(random_blocks(2, 13))
    model(**JRTDataCollator.from_config(config, seed=0)(blocks))  # the model's own prefix length: accepted
    other = JRTDataCollator(prefix_length=config.prefix_length - 2, mask_token_id=MASK_ID, seed=0)
    with pytest.raises(ValueError, match=r"built for prefix_length \[6\].*config.prefix_length is 8.*from_config"):
        model(**other(blocks))


def test_ignore_prefix_targets():
    labels = torch.arange(12).view(2, 6)
    expected = torch.tensor([[-100, -100, 2, 3, 4, 5], [-100, -100, -100, -100, 10, 11]])
    torch.testing.assert_close(ignore_prefix_targets(labels, torch.tensor([2, 4])), expected)
    torch.testing.assert_close(ignore_prefix_targets(labels, 2)[0], expected[0])


@pytest.mark.parametrize(
    "prefix, error, message",
    [
        (-2, ValueError, r"^prefix_length must be >= 0; got -2\.$"),
        (torch.tensor([3, -1]), ValueError, r"^prefix_length must be >= 0 in every row; got \[3, -1\]\.$"),
        (2.5, TypeError, r"^prefix_length must be an int or a \(B,\) LongTensor; got float\.$"),
        (True, TypeError, r"^prefix_length must be an int or a \(B,\) LongTensor; got bool\.$"),
        (torch.tensor([2.0, 3.0]), ValueError, r"^prefix_length must be an int or a \(B,\) = \(2,\) integer tensor"),
        (torch.tensor([1, 2, 3]), ValueError, r"^prefix_length must be an int or a \(B,\) = \(2,\) integer tensor"),
    ],
)
def test_ignore_prefix_targets_and_forward_share_one_rule(make_config, prefix, error, message):
    """A prefix that forward refuses is refused by `ignore_prefix_targets` with the same error (it used to return the
    labels unchanged for -2)."""
    labels = torch.randint(4, 99, (2, 6))
    with pytest.raises(error, match=message):
        ignore_prefix_targets(labels, prefix)
    model = JRTRNNForCausalLM(make_config()).eval()
    with pytest.raises(error, match=message):
        model(labels, labels=labels, prefix_length=prefix)


def test_mlm_labels_need_labels(make_config):
    model = JRTRNNForCausalLM(make_config())
    with pytest.raises(ValueError, match="need `labels`"):
        model(input_ids=torch.randint(4, 98, (1, 12)), mlm_labels=torch.full((1, 12), -100))


@pytest.mark.parametrize("mask_sampling", ["fixed", "bernoulli"])
def test_split_batch_with_num_items_in_batch(mask_sampling):
    """Two micro-batches normalised by the step's NTP count add up to the full-batch objective (fixed count), or to
    the mean of the micro-batch objectives (Bernoulli, as the reference across GPUs)."""
    logits = torch.randn(4, 40, 11)
    tokens = torch.randint(0, 11, (4, 40))
    batch = JRTDataCollator(24, 10, mlm_probability=0.15, mask_sampling=mask_sampling, seed=0)(list(tokens))
    halves = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 2), slice(2, 4))]
    num_items = (batch["labels"][:, 1:] != -100).sum()

    def loss(part, logits, num_items_in_batch=None):
        return jrt_loss(logits, part["labels"], part["mlm_labels"], mlm_weight=0.25,
                        num_items_in_batch=num_items_in_batch)[0]

    accumulated = loss(halves[0], logits[:2], num_items) + loss(halves[1], logits[2:], num_items)
    if mask_sampling == "fixed":
        torch.testing.assert_close(accumulated, loss(batch, logits))
    else:
        torch.testing.assert_close(accumulated, (loss(halves[0], logits[:2]) + loss(halves[1], logits[2:])) / 2)


# ---------------------------------------------------------------------------------------------------- Trainer


def train_one_step(config, blocks, output_dir, *, batch_size, accumulation) -> JRTRNNForCausalLM:
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(config)
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no", seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=BlockDataset(blocks),
                      data_collator=JRTDataCollator.from_config(config, mlm_probability=0.5, seed=1))
    trainer.train()
    return model


def test_trainer_gradient_accumulation_matches_the_full_batch(make_config, tmp_path):
    config = make_config(mask_token_id=MASK_ID)
    blocks = random_blocks(4, 19)
    torch.manual_seed(0)
    initial = {name: p.detach().clone() for name, p in JRTRNNForCausalLM(config).named_parameters()}
    full = train_one_step(config, blocks, tmp_path / "full", batch_size=4, accumulation=1)
    accumulated = train_one_step(config, blocks, tmp_path / "accumulated", batch_size=2, accumulation=2)

    for name, parameter in full.named_parameters():
        update_full = parameter.detach() - initial[name]
        update_accumulated = dict(accumulated.named_parameters())[name].detach() - initial[name]
        torch.testing.assert_close(update_accumulated, update_full, rtol=1e-4, atol=1e-6, msg=name)
    assert (full.model.embed_tokens.weight - initial["model.embed_tokens.weight"]).abs().max() > 1e-3
    assert full.config.use_cache is False  # what Trainer leaves behind: the examples restore it before saving


def test_trainer_keeps_labels_as_its_only_label_name(make_config, tmp_path):
    """`mlm_labels` is a loss kwarg, so plain causal-LM evaluation batches still get an eval loss."""
    config = make_config(mask_token_id=MASK_ID)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_eval_batch_size=2)
    blocks = random_blocks(4, 16)
    eval_dataset = [{"input_ids": b, "labels": b} for b in blocks]
    trainer = Trainer(model=JRTRNNForCausalLM(config), args=args, eval_dataset=eval_dataset)
    assert trainer.label_names == ["labels"]
    assert trainer.evaluate()["eval_loss"] > 0


def test_jrt_trainer_logs_the_two_parts_of_the_objective(make_config, tmp_path):
    """One micro-batch per logged step: the logged `loss` is `ntp_loss + mlm_weight * mlm_loss` of that step."""
    from jrt_train.trainer import JRTTrainer

    config = make_config(mask_token_id=MASK_ID)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, logging_steps=1, use_cpu=True,
        report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0,
    )
    trainer = JRTTrainer(model=JRTRNNForCausalLM(config), args=args, train_dataset=BlockDataset(random_blocks(6, 19)),
                         data_collator=JRTDataCollator.from_config(config, mlm_probability=0.5, seed=1))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3
    for entry in logged:
        assert entry["mlm_loss"] > 0 and entry["ntp_loss"] > 0
        assert entry["loss"] == pytest.approx(entry["ntp_loss"] + config.mlm_weight * entry["mlm_loss"], abs=2e-3)
    assert trainer.loss_parts == {"ntp_loss": [], "mlm_loss": []}  # each log takes the parts it reports


# ---------------------------------------------------------------------------------------------------- LoRA


def test_lora_trains_only_the_adapter_and_merges_exactly(make_config, tmp_path):
    from peft import PeftModel, get_peft_model

    config = make_config(mask_token_id=MASK_ID)
    JRTRNNForCausalLM(config).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model = get_peft_model(base, default_lora_config())
    targeted = {name.split(".")[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert targeted == set(jrt_train.LORA_TARGET_MODULES)  # every projection kind of the tiny model; no conv

    batch = JRTDataCollator.from_config(config, seed=0)(list(random_blocks(2, 15)))
    model(**batch).loss.backward()
    for name, parameter in model.named_parameters():
        is_adapter = "lora_" in name
        assert parameter.requires_grad == is_adapter, name
        assert (parameter.grad is not None) == is_adapter, name
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n)

    with torch.no_grad():  # lora_B starts at zero (a no-op adapter): make the adapter change the model
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    model.eval()
    input_ids = torch.randint(4, 98, (2, 13))
    adapted = model(input_ids=input_ids).logits
    with model.disable_adapter():
        assert (model(input_ids=input_ids).logits - adapted).abs().max() > 1e-3

    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(reloaded.eval()(input_ids=input_ids).logits, adapted)
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, JRTRNNForCausalLM)
    torch.testing.assert_close(merged(input_ids=input_ids).logits, adapted, rtol=1e-5, atol=1e-5)

    prompt = input_ids[:1, :5]
    generated = merged.generate(prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, 11)
    torch.testing.assert_close(generated, model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False))


def test_a_lora_model_has_the_base_models_leak_free_loss(make_config):
    """A LoRA model (its adapter a no-op at the start) scores what the base model scores, on completion-only labels
    of a left-padded batch: the labels rule runs through PEFT's wrappers."""
    from peft import get_peft_model

    torch.manual_seed(0)
    base = JRTRNNForCausalLM(make_config(prefix_length=8)).train()
    input_ids = torch.randint(4, 98, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :6] = -100  # prompts of 3 and 6 tokens, completions of 6
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    expected = base(**batch).loss
    torch.testing.assert_close(get_peft_model(base, default_lora_config())(**batch).loss, expected)


def test_shift_labels_with_an_empty_prefix(make_config):
    model = JRTRNNForCausalLM(make_config()).eval()
    input_ids = torch.randint(4, 99, (2, 12))
    shifted = torch.nn.functional.pad(input_ids, (0, 1), value=-100)[:, 1:]
    expected = model(input_ids, labels=input_ids, prefix_length=0).loss
    torch.testing.assert_close(model(input_ids, labels=input_ids, shift_labels=shifted, prefix_length=0).loss, expected)


def test_completion_only_labels_make_the_prompt_the_prefix(make_config):
    """`Trainer` with completion-only labels (-100 over the prompt) on rows shorter than the prefix: a finite loss,
    the cross-entropy over the completion read with the prompt (filled) as the prefix."""
    model = JRTRNNForCausalLM(make_config(prefix_length=32)).eval()
    input_ids = torch.randint(4, 99, (2, 12))
    labels = input_ids.clone()
    labels[:, :7] = -100  # a 7-token prompt, a 5-token completion
    loss = model(input_ids, labels=labels).loss
    assert torch.isfinite(loss)
    logits = model(input_ids, prompt_lengths=torch.full((2,), 7)).logits
    expected = torch.nn.functional.cross_entropy(logits[:, 6:-1].reshape(-1, 99), input_ids[:, 7:].reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_a_fine_tuned_model_generates_what_its_training_forward_predicts(make_config):
    """Train as you generate: after a few steps on completion-only labels, the first token `generate()` gives for a
    prompt is the argmax of the training forward's logits at the prompt's last position (both read the prompt with
    the same fill)."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(make_config(prefix_length=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    input_ids = torch.randint(4, 99, (4, 10), generator=torch.Generator().manual_seed(3))
    labels = input_ids.clone()
    labels[:, :6] = -100  # 6-token prompts (shorter than the prefix: filled), 4-token completions
    model.train()
    for _ in range(5):
        model(input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        training_logits = model(input_ids, labels=labels).logits
    first = model.generate(input_ids[:, :6], max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.testing.assert_close(first[:, 6], training_logits[:, 5].argmax(-1), rtol=0, atol=0)
