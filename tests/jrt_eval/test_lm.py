"""`JRTLM` (lm-eval model `jrt`): leak-free loglikelihood, batch invariance, the reference mode's leak, generation."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_config

pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
from lm_eval.api.instance import Instance  # noqa: E402

import modeling_jrt  # noqa: E402
from jrt_eval import JRTLM  # noqa: E402

PAIRS = [  # (context, continuation): contexts shorter and longer than the prefix (16 tokens), mixed lengths
    ("Kalo Company", " was founded in 1871."),
    ("Name: Zenmir", " Founded: 1790"),
    ("The mascot of Kalo Company is Zorbin Vale and its color is jade.", " jade"),
    ("Bex", " Tudro Company has its headquarters in Ostrava."),
    ("Profile of Varel Company. Founded: 1765", " Headquarters: Mirsa"),
]


@pytest.fixture(scope="module")
def tiny_jrt(byte_bpe_tokenizer):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(byte_bpe_tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         prefix_pad_token_id=0, prefix_length=16)
    model = modeling_jrt.JRTRNNForCausalLM(config).eval()
    with torch.no_grad():  # a random init barely uses the encoder: make the prefix matter
        for layer in model.model.layers:
            if layer.layer_type == "linear_attention":
                layer.mixer.k_enc_proj.weight.mul_(4.0)
                layer.mixer.v_enc_proj.weight.mul_(4.0)
    return model


def make_lm(model, tokenizer, **kwargs) -> JRTLM:
    return JRTLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", **kwargs)


def scores(lm: JRTLM, pairs) -> list[float]:
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    return [score for score, _ in lm.loglikelihood(requests, disable_tqdm=True)]


@torch.no_grad()
def manual_token_logprobs(model, context_ids: list[int], continuation_ids: list[int]) -> torch.Tensor:
    """Per-token log-probs `(N,)` of the continuation, one row alone, the prefix being the context."""
    ids = torch.tensor([context_ids + continuation_ids[:-1]])
    logits = model(ids, prefix_length=min(len(context_ids), model.config.prefix_length)).logits.double()
    logprobs = logits.log_softmax(-1)[0, len(context_ids) - 1 :]  # (N, V)
    return logprobs.gather(-1, torch.tensor(continuation_ids)[:, None])[:, 0]


def test_scores_equal_one_row_manual_computation_for_batch_sizes_1_and_4(tiny_jrt, byte_bpe_tokenizer):
    lm1 = make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=1)
    lm4 = make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=4)
    expected = [manual_token_logprobs(tiny_jrt, *lm1._encode_pair(*pair)).sum().item() for pair in PAIRS]
    lengths = {len(sum(lm1._encode_pair(*pair), [])) for pair in PAIRS}
    assert len(lengths) == len(PAIRS)  # every batch of 4 is right-padded
    torch.testing.assert_close(scores(lm1, PAIRS), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(scores(lm4, PAIRS), expected, rtol=0, atol=1e-4)
    assert lm4.logits_cache is False


def test_later_continuation_tokens_do_not_change_earlier_token_scores(tiny_jrt, byte_bpe_tokenizer):
    """The score of the first k continuation tokens is the same, whatever follows them."""
    lm = make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=3)
    context = lm.tok_encode("Kalo Company")
    head = lm.tok_encode(" was founded")
    tails = [lm.tok_encode(" in 1871."), lm.tok_encode(" by Zorbin Vale of Ostrava")]
    requests = [((None, None), context, head)] + [((None, None), context, head + tail) for tail in tails]
    head_score, *full_scores = [score for score, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]
    for tail, full_score in zip(tails, full_scores):
        per_token = manual_token_logprobs(tiny_jrt, context, head + tail)
        assert per_token[: len(head)].sum().item() == pytest.approx(head_score, abs=1e-4)
        assert per_token.sum().item() == pytest.approx(full_score, abs=1e-4)


def test_reference_scoring_reproduces_the_leak(tiny_jrt, byte_bpe_tokenizer):
    leak_free = scores(make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=2), PAIRS)
    reference = scores(make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=2, scoring="reference"), PAIRS)
    lm = make_lm(tiny_jrt, byte_bpe_tokenizer)
    for (context, continuation), free, ref in zip(PAIRS, leak_free, reference):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        if len(context_ids) + len(continuation_ids) - 1 <= tiny_jrt.config.prefix_length:
            # The whole row is inside the reference's encoder: the continuation is read non-causally.
            assert abs(free - ref) > 1e-3, (context, continuation)
    assert any(abs(free - ref) > 1e-3 for free, ref in zip(leak_free, reference))

    # The leak itself: in reference mode the first token's score depends on the tokens after it.
    context = lm.tok_encode("Bex")
    requests = [((None, None), context, lm.tok_encode(tail)) for tail in (" Tudro", " Tudro Company")]
    reference_lm = make_lm(tiny_jrt, byte_bpe_tokenizer, scoring="reference")
    first = lm.tok_encode(" Tudro")
    short, _ = reference_lm._loglikelihood_tokens(requests[:1], disable_tqdm=True)[0]
    manual_free = manual_token_logprobs(tiny_jrt, context, lm.tok_encode(" Tudro Company"))[: len(first)].sum()
    assert short != pytest.approx(manual_free.item(), abs=1e-3)


def test_unknown_scoring_mode(tiny_jrt, byte_bpe_tokenizer):
    with pytest.raises(ValueError, match="`scoring` must be one of leak_free, reference"):
        make_lm(tiny_jrt, byte_bpe_tokenizer, scoring="leaky")


def test_generate_until_equals_direct_generate(tiny_jrt, byte_bpe_tokenizer):
    lm = make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=3)
    prompts = ["Kalo Company was founded in", "Name: Zenmir\nFounded:", "The mascot of Varel Company is"]
    gen_kwargs = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    requests = [Instance("generate_until", {}, (prompt, dict(gen_kwargs)), i) for i, prompt in enumerate(prompts)]
    generated = lm.generate_until(requests, disable_tqdm=True)
    for prompt, text in zip(prompts, generated):
        batch = byte_bpe_tokenizer([prompt], return_tensors="pt")
        output = tiny_jrt.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0)
        direct = byte_bpe_tokenizer.decode(output[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        assert text == direct.split("\n")[0]


def test_loglikelihood_rolling_reads_one_token_of_prefix(tiny_jrt, byte_bpe_tokenizer):
    """Rolling windows have the prefix token as context: the JRT prefix is that one token, nothing after it."""
    lm = make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=2)
    texts = ["Kalo Company was founded in 1871.", "Zorbin Vale is the mascot of Varel Company, in jade."]
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), i)
                                        for i, text in enumerate(texts)], disable_tqdm=True)
    for text, score in zip(texts, rolling):
        expected = manual_token_logprobs(tiny_jrt, [lm.prefix_token_id], lm.tok_encode(text)).sum().item()
        assert score == pytest.approx(expected, abs=1e-4)


def test_causal_based_model_scores_like_hflm(byte_bpe_tokenizer):
    from lm_eval.models.huggingface import HFLM

    config = tiny_config(vocab_size=len(byte_bpe_tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         linear_attention_type="causal")
    model = modeling_jrt.JRTRNNForCausalLM(config).eval()
    lm = make_lm(model, byte_bpe_tokenizer, batch_size=4)
    assert lm.logits_cache is True  # a causal model keeps HFLM's logits cache
    stock = HFLM(pretrained=model, tokenizer=byte_bpe_tokenizer, device="cpu", batch_size=4)
    expected = [manual_token_logprobs(model, *lm._encode_pair(*pair)).sum().item() for pair in PAIRS]
    torch.testing.assert_close(scores(lm, PAIRS), scores(stock, PAIRS), rtol=0, atol=1e-5)
    torch.testing.assert_close(scores(lm, PAIRS), expected, rtol=0, atol=1e-4)


@torch.no_grad()
def test_reference_scoring_is_the_reference_protocol(tiny_jrt, byte_bpe_tokenizer):
    """Reference mode = context + continuation left-filled to `prefix_length` with the prefix pad token, last token
    dropped, fill masked in the linear attention, default prefix (docs/reference_architecture.md §2.1)."""
    lm = make_lm(tiny_jrt, byte_bpe_tokenizer, scoring="reference")
    pair = ("Kalo Company", " was")
    context, continuation = lm._encode_pair(*pair)
    fill = tiny_jrt.config.prefix_length - len(context) - len(continuation)
    assert fill > 0
    tokens = [tiny_jrt.config.prefix_pad_token_id] * fill + context + continuation[:-1]
    mask = torch.tensor([[0] * fill + [1] * (len(tokens) - fill)])
    logits = tiny_jrt(torch.tensor([tokens]), linear_attention_mask=mask).logits.double()
    logprobs = logits.log_softmax(-1)[0, fill + len(context) - 1 :]
    expected = logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum().item()
    assert scores(lm, [pair])[0] == pytest.approx(expected, abs=1e-4)


def test_jrt_window_defaults_to_the_reference_2048(tiny_jrt, byte_bpe_tokenizer):
    tokenizer = copy.deepcopy(byte_bpe_tokenizer)
    tokenizer.model_max_length = 1024  # GPT-2's tokenizer says 1024; JRT-RNN has no position limit
    assert make_lm(tiny_jrt, tokenizer).max_length == 2048
    assert make_lm(tiny_jrt, tokenizer, max_length=300).max_length == 300


def test_bf16_autocast_option(tiny_jrt, byte_bpe_tokenizer):
    """`mixed_precision_dtype=bfloat16` (HFLM's option) runs scoring and generation under bf16 autocast, as the
    reference evaluated; scores stay close to fp32."""
    lm = make_lm(tiny_jrt, byte_bpe_tokenizer, batch_size=4, mixed_precision_dtype="bfloat16")
    assert lm.mixed_precision_dtype == torch.bfloat16
    bf16, fp32 = scores(lm, PAIRS), scores(make_lm(tiny_jrt, byte_bpe_tokenizer), PAIRS)
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.5)
    assert bf16 != fp32  # the projections did run in bf16
    request = Instance("generate_until", {}, ("Kalo Company was founded in", {"until": ["\n"], "max_gen_toks": 4}), 0)
    assert isinstance(lm.generate_until([request], disable_tqdm=True)[0], str)


def test_a_folder_loads_as_a_causal_lm_without_the_model_type_warning(caplog, tmp_path):
    """`jrt` knows it loads causal LMs: HFLM's "neither marked as CausalLM or Seq2SeqLM" warning is gone. The
    end-of-text id is the tokenizer's EOS (`<bos>` in the demo models); a tokenizer without one (and a model without
    one) falls back to the pad token for HFLM's stop string."""
    import json
    import logging
    import shutil

    from jrt_cli.choices import MODELS_DIR

    with caplog.at_level(logging.WARNING):
        lm = JRTLM(pretrained=str(MODELS_DIR / "jrt-rnn-sd"), device="cpu", dtype="float32")
    assert lm.backend == "causal"
    assert not [r for r in caplog.records if "neither marked as CausalLM" in r.getMessage()]
    assert lm.eot_token_id == lm.tokenizer.eos_token_id == 1

    folder = shutil.copytree(MODELS_DIR / "jrt-rnn-sd", tmp_path / "no-eos")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    lm = JRTLM(pretrained=str(folder), device="cpu", dtype="float32")
    assert lm.tokenizer.eos_token_id is None and lm.eot_token_id == lm.tokenizer.pad_token_id == 0
