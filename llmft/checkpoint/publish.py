"""Publishing an exported directory to the Hugging Face Hub: `llmft export --push_to_hub` and `llmft push`.

Everything goes through huggingface_hub (`create_repo`, then `upload_folder`): the token is the one huggingface_hub
finds (HF_TOKEN, or `hf auth login`'s), never printed or passed on a command line; HF_ENDPOINT points it elsewhere.
`upload_folder` makes one commit at the end; before it, the Hub is asked how each file goes, and large files it
already holds (by content hash) are not sent again, so a rerun after an interrupted upload resumes
(huggingface_hub's behaviour; the tests' stand-in Hub takes every file inline and checks what arrives).
"""

from __future__ import annotations

import re
from pathlib import Path

from llmft.checkpoint.run_dir import CheckpointError

# The Hub's rule for a repository name part: letters, digits, '-', '_', '.', not starting or ending with '-' or '.',
# no '--' or '..', at most 96 characters (huggingface_hub.utils.validate_repo_id).
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_PART}/{_PART}$")


def check_repo_id(name: str, flag: str = "--push_to_hub") -> str:
    """ORG/NAME as the Hub spells repositories; anything else is one line naming the form."""
    if not _REPO_ID.match(name or "") or "--" in name or ".." in name:
        raise CheckpointError(
            f"{flag} {name!r} is not ORG/NAME: give the Hub repository as owner/name, e.g. my-org/my-model "
            "(letters, digits, '-', '_', '.')"
        )
    return name


def check_folder(folder: Path) -> None:
    """`llmft push` uploads a directory `llmft export` wrote: a model or an adapter, with its model card."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory: pass the directory `llmft export --out` wrote")
    if not any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise CheckpointError(
            f"{folder} holds no config.json or adapter_config.json: pass the directory `llmft export --out` wrote"
        )


def push_folder(folder: Path, repo_id: str, private: bool, say=print) -> str:
    """Create the repository (kept if it exists) and upload the folder in one commit; returns the commit's URL."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        say(f"uploading {folder} to {url}")
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            commit_message="Upload model exported by llmft",
        )
    except HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"the Hub refused the upload to {repo_id} ({first}): check the name and that your token "
            "(HF_TOKEN or `hf auth login`) may write there"
        ) from None
    except ValueError as e:  # huggingface_hub's "Invalid metadata in README.md"
        raise CheckpointError(
            f"the Hub refused {folder}/README.md's metadata ({e}): fix the card and push again"
        ) from None
    except (httpx.TransportError, OSError) as e:  # no network, a refused connection
        raise CheckpointError(
            f"cannot reach the Hub for {repo_id} ({type(e).__name__}): compute nodes often have no internet; "
            "run `llmft push DIR ORG/NAME` from a login node"
        ) from None
    return getattr(info, "commit_url", None) or str(url)
