"""Load saved folders with `trust_remote_code=True` alone and record what a user of this transformers release gets.

Run by `test_cross_release.py` as `python -I isolated_checks.py RESULTS FOLDER...` with this distribution's packages
blocked from import (what runs here must work from a Hub folder alone). Everything is recorded, nothing asserted, so
that the test reports every difference at once; `expected.pt` in each folder holds the newest release's outputs.
"""

import logging
import sys
import traceback
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
SETTINGS = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


class Warnings(logging.Handler):
    """Every warning logged while a folder loads (transformers' `logger.warning_once` included)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def error_of(call) -> str | None:
    """`"ExceptionType: message"` of what `call()` raises, or None when it returns."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for the test to judge
        return f"{type(error).__name__}: {error}"
    return None


def check_folder(folder: str) -> dict:
    expected = torch.load(Path(folder) / "expected.pt")
    input_ids, attention_mask = expected["input_ids"], expected["attention_mask"]
    new = (expected["generated"].shape[1] - input_ids.shape[1])
    record: dict = {}
    handler = Warnings()
    logging.getLogger().addHandler(handler)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    finally:
        logging.getLogger().removeHandler(handler)
    model.eval()
    record["module"] = type(model).__module__
    record["loading_info"] = {key: sorted(map(str, value)) for key, value in info.items()}
    record["load_warnings"] = handler.messages
    record["mixer_types"] = list(model.config.mixer_types)
    record["config_has_layer_types"] = getattr(model.config, "layer_types", None) is not None
    record["prefix_strategy"] = model.config.prefix_strategy
    with torch.no_grad():
        record["logits"] = model(input_ids, attention_mask=attention_mask).logits
    record["generated"] = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new, **SETTINGS)

    # A second turn from the returned cache, under the cache's name on this release and under the other one.
    for name in ("cache", "past_key_values"):
        first = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new,
                               return_dict_in_generate=True, **SETTINGS)
        cache = getattr(first, CACHE_FIELD)
        mask = torch.cat([attention_mask, attention_mask.new_ones(2, new)], dim=1)
        try:
            second = model.generate(first.sequences, attention_mask=mask, max_new_tokens=new, **{name: cache},
                                    **SETTINGS)
            record[f"two_turns[{name}]"] = second
        except Exception:  # noqa: BLE001
            record[f"two_turns[{name}]"] = traceback.format_exc(limit=3)
        # That cache has read every column of `second`'s input: given the first prompt again, it is stale, with
        # the padding mask and (one unpadded row, whose all-ones mask generate() drops) without one.
        record[f"stale[{name}]"] = error_of(
            lambda: model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, **{name: cache},
                                   **SETTINGS)
        )
        row = input_ids[1:]
        single = model.generate(row, max_new_tokens=new, return_dict_in_generate=True, **SETTINGS)
        record[f"stale_unpadded[{name}]"] = error_of(
            lambda: model.generate(row, max_new_tokens=2, **{name: getattr(single, CACHE_FIELD)}, **SETTINGS)
        )
    record["prompt_lookup"] = error_of(
        lambda: model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, prompt_lookup_num_tokens=2,
                               **SETTINGS)
    )
    record["assistant_model"] = error_of(
        lambda: model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, assistant_model=model,
                               **SETTINGS)
    )
    beams = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, num_beams=2, **SETTINGS)
    record["beam_search_shape"] = tuple(beams.shape)

    if (Path(folder) / "tokenizer.json").exists():
        # The README's pipeline example: a batch of two prompts of different lengths (left padding).
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = input_ids[:, -6:].clamp(min=4)
        prompts = [tokenizer.decode(ids[0, 3:]), tokenizer.decode(ids[1])]
        generator = pipeline("text-generation", model=folder, trust_remote_code=True)
        outputs = generator(prompts, max_new_tokens=2, do_sample=False, return_full_text=False)
        record["pipeline"] = [output[0]["generated_text"] for output in outputs]
        direct = []
        for text in prompts:
            encoded = tokenizer(text, return_tensors="pt")
            tokens = model.generate(**encoded, max_new_tokens=2, do_sample=False)
            direct.append(tokenizer.decode(tokens[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True))
        record["pipeline_expected"] = direct
    return record


def main() -> None:
    results_path, *folders = sys.argv[1:]
    results = {"transformers": transformers.__version__}
    for folder in folders:
        try:
            results[folder] = check_folder(folder)
        except Exception:  # noqa: BLE001 - a folder that fails to load is a result too
            results[folder] = {"failed": traceback.format_exc()}
    torch.save(results, results_path)


if __name__ == "__main__":
    main()
