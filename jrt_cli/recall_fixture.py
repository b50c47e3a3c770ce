"""A synthetic recall data set: made-up entities, generated documents, one fact asked per record.

Every entity, place and value is invented from syllables, so no model has seen the facts in pre-training: the answer
can only come from the document. Each document lists several entities with the same attributes, so the model has to
recall the right one (the recall-intensive setting of JRT-Prompt). Half of the records are information extraction
(SWDE/FDA style: a semi-structured profile page and an attribute key), half document QA (prose and a
completion-style question with its natural-language header).

`python -m jrt_cli.recall_fixture > examples/data/recall_fixture.jsonl` regenerates the shipped file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

_SYLLABLES = ("ka", "lo", "mir", "zen", "tu", "var", "el", "dro", "qui", "sa", "nor", "bex", "ri", "fal", "gu", "ost")
_COLORS = ("amber", "teal", "crimson", "ochre", "violet", "slate", "jade", "ivory")
# (key of the extraction record, phrase of the QA record, natural question, how a value is drawn)
_ATTRIBUTES = (("founded", "was founded in", "When was {} founded?", "year"),
               ("headquarters", "has its headquarters in", "Where are the headquarters of {}?", "place"),
               ("mascot", "has a mascot called", "What is the mascot of {}?", "name"),
               ("color", "uses the signature color", "What is the signature color of {}?", "color"))


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


def _value(rng: random.Random, kind: str) -> str:
    if kind == "year":
        return str(rng.randint(1700, 1999))
    if kind == "place":
        return _word(rng, 3)
    return _word(rng, 2) + " " + _word(rng, 2) if kind == "name" else rng.choice(_COLORS)


def make_fixture_records(num_records: int = 36, *, seed: int = 0, entities_per_document: int = 4) -> list[dict]:
    """`num_records` JSON-ready records in the `jrt eval-recall` format, alternating extraction and QA.

    Extraction records carry `context`, `key`, `answers`, `template: "extraction"`; QA records `context`,
    `question`, `header`, `answers`, `template: "qa"`. Ids are `"syn-000"`, `"syn-001"`, ... The output depends only
    on the arguments.
    """
    rng = random.Random(seed)
    records = []
    for index in range(num_records):
        names = [f"{_word(rng, 2)} {_word(rng, 1)} Company" for _ in range(entities_per_document)]
        facts = {name: {key: _value(rng, kind) for key, _, _, kind in _ATTRIBUTES} for name in names}
        target = names[0]
        key, phrase, natural_question, _ = rng.choice(_ATTRIBUTES)
        record: dict = {"id": f"syn-{index:03d}"}
        if index % 2 == 0:
            # A profile page of the target entity, then directory listings of the others.
            sections = [
                "\n".join([f"Name: {name}"] + [f"{k.capitalize()}: {v}" for k, v in facts[name].items()])
                for name in names
            ]
            context = f"Profile of {target}.\n{sections[0]}\n\nOther companies in the directory.\n\n"
            record.update(context=context + "\n\n".join(sections[1:]), key=key, template="extraction")
        else:
            sentences = [f"{name} {p} {facts[name][k]}." for name in names for k, p, _, _ in _ATTRIBUTES]
            rng.shuffle(sentences)
            record.update(context=" ".join(sentences), question=f"{target} {phrase}",
                          header=natural_question.format(target), template="qa")
        record["answers"] = [facts[target][key]]
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jrt_cli.recall_fixture",
        description="Write the synthetic recall records (JSON Lines, the `jrt eval-recall --data` format) to stdout. "
        "`python -m jrt_cli.recall_fixture > examples/data/recall_fixture.jsonl` regenerates the shipped file.",
    )
    parser.add_argument("--records", type=int, default=36, help="number of records (default 36, the shipped file)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the made-up facts (default 0)")
    args = parser.parse_args(argv)
    if args.records < 1:
        parser.error(f"--records must be >= 1, got {args.records}")
    for record in make_fixture_records(args.records, seed=args.seed):
        sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["make_fixture_records"]
