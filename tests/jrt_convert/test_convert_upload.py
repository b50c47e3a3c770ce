"""`--push-to-hub` with the network disabled and huggingface_hub's repo-creation and commit calls mocked."""

from __future__ import annotations

from unittest import mock

import huggingface_hub.constants
import pytest
from huggingface_hub import CommitInfo, HfApi
from huggingface_hub.errors import HfHubHTTPError
from reference_checkpoints import reference_config, reference_state_dict, write_reference_checkpoint

from jrt_cli.main import main as jrt_main
from jrt_convert import push_to_hub


@pytest.fixture
def offline_hub(monkeypatch):
    """No network, no Xet upload pipeline (so upload_folder makes one create_commit call)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    commit = CommitInfo(
        commit_url="https://huggingface.co/me/jrt-hf/commit/abc", commit_message="m", commit_description="",
        oid="abc", pr_url="https://huggingface.co/me/jrt-hf/discussions/1",
    )
    with (
        mock.patch.object(HfApi, "create_repo") as create_repo,
        mock.patch.object(HfApi, "create_branch") as create_branch,
        mock.patch.object(HfApi, "create_commit", return_value=commit) as create_commit,
        mock.patch.object(HfApi, "_validate_yaml"),  # the model card's metadata check is a server call
    ):
        yield create_repo, create_branch, create_commit


def _convert(tmp_path, capsys, *extra: str) -> int:
    config = reference_config("jrt")
    write_reference_checkpoint(tmp_path / "src", config, reference_state_dict(config), lightning=False)
    code = jrt_main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--push-to-hub", "me/jrt-hf", *extra])
    return code


def test_push_to_hub_uploads_the_folder(tmp_path, capsys, offline_hub):
    create_repo, create_branch, create_commit = offline_hub
    assert _convert(tmp_path, capsys, "--private", "--create-pr") == 0
    assert create_repo.call_count == 2  # the pre-flight check before converting, then the upload itself
    assert create_repo.call_args.kwargs == {"repo_id": "me/jrt-hf", "private": True, "repo_type": "model",
                                            "exist_ok": True}
    create_branch.assert_not_called()
    create_commit.assert_called_once()
    kwargs = create_commit.call_args.kwargs
    assert kwargs["repo_id"] == "me/jrt-hf" and kwargs["create_pr"] is True and kwargs["revision"] is None
    uploaded = sorted(op.path_in_repo for op in kwargs["operations"])
    local = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert uploaded == local
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "modeling_jrt.py",
            "configuration_jrt.py", "linear_attention.py"} <= set(uploaded)
    assert "uploaded to https://huggingface.co/me/jrt-hf/discussions/1" in capsys.readouterr().out


def test_push_to_a_branch(tmp_path, capsys, offline_hub):
    create_repo, create_branch, create_commit = offline_hub
    assert _convert(tmp_path, capsys, "--revision", "converted") == 0
    assert create_repo.call_args.kwargs["private"] is False
    create_branch.assert_called_once_with(repo_id="me/jrt-hf", branch="converted", repo_type="model", exist_ok=True)
    kwargs = create_commit.call_args.kwargs
    assert kwargs["revision"] == "converted" and kwargs["create_pr"] is False
    assert "uploaded to https://huggingface.co/me/jrt-hf/commit/abc" in capsys.readouterr().out


def test_failed_upload_keeps_the_folder_and_says_how_to_retry(tmp_path, capsys, offline_hub):
    _, _, create_commit = offline_hub
    response = mock.Mock(status_code=403, headers={})
    create_commit.side_effect = HfHubHTTPError("403 Forbidden: no write access", response=response)
    assert _convert(tmp_path, capsys) == 1
    err = capsys.readouterr().err
    assert "Upload to 'me/jrt-hf' failed" in err and "403 Forbidden" in err
    assert f"hf upload me/jrt-hf {tmp_path / 'out'} ." in err
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_create_pr_with_a_branch_is_refused(tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="cannot be combined with --revision 'dev'"):
        push_to_hub(tmp_path / "folder", "me/jrt-hf", revision="dev", create_pr=True)
