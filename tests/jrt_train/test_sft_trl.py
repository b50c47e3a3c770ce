"""TRL `SFTTrainer` on prompt-completion data: the prompt is the JRT prefix and the encoder never reads a token that
is scored, on TRL's own loss path (its fused LM head replaces `forward` and calls the backbone without labels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modeling_jrt import JRTRNNForCausalLM

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<sp>": 3}
    vocab.update({f"w{i}": i for i in range(4, 99)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def prompt_completion_dataset(rows: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(rows):
        prompt = torch.randint(4, 99, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator)
        completion = torch.randint(4, 99, (4,), generator=generator)
        examples.append({"prompt": " ".join(f"w{t}" for t in prompt.tolist()),
                         "completion": " " + " ".join(f"w{t}" for t in completion.tolist())})
    return datasets.Dataset.from_list(examples)


def trainer_for(make_config, tmp_path, completion_only_loss: bool):
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(make_config(prefix_length=16, initializer_range=0.3))
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none", use_cpu=True,
        save_strategy="no", completion_only_loss=completion_only_loss, learning_rate=1e-3,
    )
    return trl.SFTTrainer(model=model, args=args, train_dataset=prompt_completion_dataset(),
                          processing_class=word_tokenizer())


def first_batch(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(4)])


def hand_loss(model, batch) -> torch.Tensor:
    """The leak-free loss by hand: each row's prompt (the tokens before its first scored target) is its prefix."""
    labels = batch["labels"]
    prompts = []
    for row in labels:
        scored = (row[1:] != -100).nonzero()
        prompts.append(int(scored[0]) + 1 if len(scored) else row.shape[0])
    prompt_lengths = torch.tensor(prompts)
    logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"), prompt_lengths=prompt_lengths).logits
    targets = labels[:, 1:].clone()
    for index, length in enumerate(prompts):
        targets[index, : length - 1] = -100  # nothing inside the prefix is scored
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def test_sft_completion_only_loss_equals_the_hand_computed_leak_free_loss(make_config, tmp_path):
    trainer = trainer_for(make_config, tmp_path, completion_only_loss=True)
    batch = first_batch(trainer)
    assert (batch["labels"][:, :3] == -100).all()  # the prompt is not scored
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        expected = hand_loss(model, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    trainer.train()  # and it trains (two steps, no NaN)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_later_completion_token_never_changes_an_earlier_log_probability(make_config, tmp_path):
    trainer = trainer_for(make_config, tmp_path, completion_only_loss=True)
    batch = first_batch(trainer)
    model = trainer.model.eval()
    row = 0
    scored = (batch["labels"][row] != -100).nonzero().flatten()
    last = int(scored[-1])
    changed = {key: value.clone() for key, value in batch.items()}
    changed["input_ids"][row, last] = (changed["input_ids"][row, last] + 7) % 95 + 4
    changed["labels"][row, last] = changed["input_ids"][row, last]
    with torch.no_grad():
        before = model(**batch, fused_lm_head=True).log_probs
        after = model(**changed, fused_lm_head=True).log_probs
    # log_probs[:, t] scores the label at t + 1: every completion target before `last` is unchanged
    torch.testing.assert_close(after[row, : last - 1], before[row, : last - 1], rtol=0, atol=1e-6)


def test_sft_with_full_labels_never_scores_what_the_encoder_read(make_config, tmp_path):
    """completion_only_loss=False: labels = input_ids, so the prefix is the first prefix_length tokens, and TRL's
    fused log-probabilities exclude the targets inside it (they were set to -100 before TRL saw them)."""
    trainer = trainer_for(make_config, tmp_path, completion_only_loss=False)
    batch = first_batch(trainer)
    model = trainer.model.eval()
    with torch.no_grad():
        outputs = model(**batch, fused_lm_head=True)
    tokens = batch["attention_mask"].sum(-1)
    for row in range(batch["input_ids"].shape[0]):
        read = min(16, int(tokens[row]))  # the encoder's tokens (right padding: from position 0)
        assert not outputs.label_mask[row, : read - 1].any()


def test_conversational_data_with_assistant_only_loss(make_config, tmp_path):
    """The assistant's reply is scored, the user's turn is the prompt (the prefix): TRL's loss equals the
    hand-computed leak-free loss."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] }}{% endgeneration %}{% else %}{{ message['content'] }} {% endif %}{% endfor %}"
    )
    rows = [{"messages": [{"role": "user", "content": "w5 w6 w7 w8"}, {"role": "assistant", "content": " w9 w10 w11"}]},
            {"messages": [{"role": "user", "content": "w12 w13"}, {"role": "assistant", "content": " w14 w15"}]}] * 4
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(make_config(prefix_length=16, initializer_range=0.3))
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to="none",
                         use_cpu=True, save_strategy="no", assistant_only_loss=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)
    batch = first_batch(trainer)
    assert (batch["labels"][0, :4] == -100).all() and (batch["labels"][0, 4:7] != -100).all()
    model = trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(model, batch), hand_loss(model, batch), rtol=1e-4, atol=1e-4)


def test_packing_is_refused_with_the_reason(make_config, tmp_path):
    """TRL's packing puts several documents in one row (positions restart): the recurrent layers would carry one into
    the next, so the model refuses it in one line."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(make_config(prefix_length=16))
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                         use_cpu=True, save_strategy="no", packing=True, max_length=32)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=prompt_completion_dataset(),
                             processing_class=word_tokenizer())
    with pytest.raises(ValueError, match="packed sequences .* are not supported"):
        trainer.train()
