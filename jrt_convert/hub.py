"""Hugging Face Hub I/O: download a reference checkpoint, upload a converted folder."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download

from .source_files import CONFIG_NAME, LIGHTNING_SUFFIX, WEIGHTS_NAME, ConversionError

try:  # huggingface_hub speaks HTTP through httpx (httpx2 in recent releases); its transport errors are not OSErrors
    from httpx2 import HTTPError as _TransportError
except ImportError:
    try:
        from httpx import HTTPError as _TransportError
    except ImportError:
        _TransportError = OSError

# Errors of a Hub call: HfHubHTTPError and OfflineModeIsEnabled are OSErrors; a refused connection is an httpx error.
HUB_ERRORS = (OSError, ValueError, _TransportError)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(source: str) -> bool:
    """Whether `source` is shaped like a Hub repo id (`owner/name`)."""
    return bool(_REPO_ID.match(source))


def download_reference_checkpoint(repo_id: str, *, revision: str | None = None) -> Path:
    """Download `config.json` and the weights of a reference checkpoint from the Hub; returns the local folder."""
    try:
        folder = snapshot_download(
            repo_id=repo_id, revision=revision, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, f"*{LIGHTNING_SUFFIX}"]
        )
    except HUB_ERRORS as error:
        raise ConversionError(f"Could not download {repo_id!r} from the Hugging Face Hub "
                              f"({type(error).__name__}: {error}). Without network access, copy "
                              f"{CONFIG_NAME} and {WEIGHTS_NAME} from https://huggingface.co/{repo_id} "
                              "into a folder and pass that folder as SRC.") from error
    return Path(folder)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Upload a converted folder to the Hub: create the repo (and branch), then one `upload_folder` commit.

    Args:
        folder: the converted folder (left untouched whatever happens).
        repo_id: target `owner/name`.
        private: create the repo as private (ignored when it already exists).
        revision: branch to commit to (created from main when missing); default main.
        create_pr: open a pull request instead of committing to the branch directly.
        commit_message: default "Upload converted JRT-RNN / Based checkpoint".
        token: a Hub token; default: the locally stored login.

    Returns the URL of the commit (of the pull request with `create_pr`); raises RuntimeError, saying how to retry,
    when the Hub refuses or cannot be reached.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"Nothing to upload: {str(folder)!r} is not a folder.")
    if create_pr and revision not in (None, "main"):
        raise ValueError("--create-pr opens a pull request against main; it "
                         f"cannot be combined with --revision {revision!r}.")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id=repo_id, private=private, repo_type="model", exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision, create_pr=create_pr,
            commit_message=commit_message or "Upload converted JRT-RNN / Based checkpoint",
        )
    except HUB_ERRORS as error:
        retry = f"hf upload {repo_id} {folder} ." + (f" --revision {revision}" if revision else "")
        retry += " --create-pr" if create_pr else ""
        raise RuntimeError(f"Upload to {repo_id!r} failed ({type(error).__name__}: "
                           f"{_first_line(error)}). The converted folder {str(folder)!r} is intact: "
                           "fix the cause (login with `hf auth login`, network, permissions) and "
                           f"retry with `{retry}`, or call jrt_convert.push_to_hub on the folder.") from error
    return commit.pr_url if create_pr and commit.pr_url else commit.commit_url


def check_hub_access(repo_id: str, *, private: bool = False, token: str | None = None) -> None:
    """Before a conversion that will be uploaded: create the repo (`exist_ok`, as the upload would), so that an
    offline machine, a missing login or a repo owned by someone else is a RuntimeError before minutes of conversion."""
    if not is_repo_id(repo_id):
        raise ValueError(f"--push-to-hub needs a Hub repo id of the form 'owner/name', got {repo_id!r}.")
    try:
        HfApi(token=token).create_repo(repo_id=repo_id, private=private, repo_type="model", exist_ok=True)
    except HUB_ERRORS as error:
        raise RuntimeError(f"Cannot upload to {repo_id!r} ({type(error).__name__}: "
                           f"{_first_line(error)}); nothing was converted. Fix the cause (network or "
                           "HF_HUB_OFFLINE, `hf auth login`, write access to the repo) and run again, "
                           "or convert without --push-to-hub and upload later with `hf upload`.") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"


__all__ = ["HUB_ERRORS", "check_hub_access", "download_reference_checkpoint", "is_repo_id", "push_to_hub"]
