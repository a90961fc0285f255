"""Publish an HF export (`python -m roformer.convert to-hf ... --push_to_hub=USER/NAME`) to the
Hugging Face Hub.

Optional: `huggingface_hub` comes with `pip install "roformer-jax[hub]"` (transformers brings
it too). The token is `HF_TOKEN` from the environment, else the login `hf auth login` saved;
it is passed to the client and never printed. The folder must be a finished export: its
config.json (with `transformers_version`), weights and model card (README.md), as `to-hf`
writes them. Without the network (or with HF_HUB_OFFLINE=1) the push stops in one line, and
the export stays where it was written, to push later (`hf upload USER/NAME FOLDER`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from roformer.errors import ConfigError, UserError
from roformer.files import EXPORT_INCOMPLETE

TOKEN_ENV = "HF_TOKEN"
EXTRA = "pip install 'roformer-jax[hub]'"
REQUIRED = ("config.json", "model.safetensors", "README.md")


class HubError(UserError):
    """The Hub refused a push or could not be reached (no network, offline mode, a token
    without write access); the export itself is complete on disk."""


def check_export(folder: Path) -> None:
    """Refuse, in one line, a folder that is not a finished HF export with its model card."""
    if not folder.is_dir():
        raise ConfigError(f"cannot push {folder}: no such directory")
    if (folder / EXPORT_INCOMPLETE).exists():
        raise ConfigError(f"cannot push {folder}: its export did not finish ({EXPORT_INCOMPLETE} is there); "
                          "export it again")
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"cannot push {folder}: it has no {', '.join(missing)} (write it with "
                          "`python -m roformer.convert to-hf`)")
    if "transformers_version" not in json.loads((folder / "config.json").read_text()):
        raise ConfigError(f"cannot push {folder}: its config.json has no transformers_version; export it again")


def push(folder: str | Path, repo_id: str, *, private: bool = False, commit_message: str | None = None) -> str:
    """Upload the export in `folder` to the Hub model repository `repo_id` (created if
    missing, private when asked) in one commit; returns the commit's URL."""
    folder = Path(folder)
    check_export(folder)
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError(f"pushing to the Hub needs huggingface_hub: {EXTRA}") from None
    token = os.environ.get(TOKEN_ENV) or None
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                   commit_message=commit_message or f"Upload {folder.name} (roformer-jax export)")
    except Exception as error:  # noqa: BLE001 - whatever the client meets (no network, offline mode, HTTP 401)
        raise HubError(f"could not push {folder} to the Hub repository {repo_id} "
                       f"({type(error).__name__}: {_first_line(error, token)}); the export is complete there: "
                       f"check the network and the token ({TOKEN_ENV} or `hf auth login`), then push it with "
                       f"`hf upload {repo_id} {folder}`") from None
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")


def _first_line(error: BaseException, token: str | None) -> str:
    line = next((part.strip() for part in str(error).splitlines() if part.strip()), "")[:300]
    return line.replace(token, "***") if token else line
