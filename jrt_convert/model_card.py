"""What every model card jrt-rnn writes shares: the Hub metadata header and the citations of the JRT and Based papers.

`jrt convert` writes the card of a converted checkpoint (`pipeline.render_model_card`), `jrt demo --export` the card
of each demo model (`jrt_cli.demo_models.render_demo_model_card`). Standard library only.
"""

from __future__ import annotations

# The Hub tags of every card (the model family and what it is built of).
TAGS: tuple[str, ...] = ("jrt-rnn", "based", "linear-attention")

CITATIONS = """@article{arora2024just,
  title={Just read twice: closing the recall gap for recurrent language models},
  author={Arora, Simran and Timalsina, Aman and Singhal, Aaryan and Eyuboglu, Sabri and Zhao, Xinyi and Rao, Ashish
          and Rudra, Atri and R{\\'e}, Christopher},
  journal={arXiv preprint arXiv:2407.05483},
  year={2024}
}

@article{arora2024simple,
  title={Simple linear attention language models balance the recall-throughput tradeoff},
  author={Arora, Simran and Eyuboglu, Sabri and Zhang, Michael and Timalsina, Aman and Alberti, Silas
          and Zinsley, Dylan and Zou, James and Rudra, Atri and R{\\'e}, Christopher},
  journal={arXiv preprint arXiv:2402.18668},
  year={2024}
}"""


def front_matter(*, license: str = "apache-2.0", base_model: str | None = None, tags: tuple[str, ...] = TAGS) -> str:
    """The YAML header the Hub reads (library, pipeline, license, base model, tags), ending with its `---` line."""
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", f"license: {license}"]
    if base_model:
        lines.append(f"base_model: {base_model}")
    lines += ["tags:", *(f"- {tag}" for tag in tags), "---"]
    return "\n".join(lines) + "\n"


def citation_section() -> str:
    """The card's last section: the BibTeX of the JRT and Based papers."""
    return f"## Citation\n\n```bibtex\n{CITATIONS}\n```\n"


__all__ = ["CITATIONS", "TAGS", "citation_section", "front_matter"]
