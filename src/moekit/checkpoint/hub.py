"""Hugging Face Hub repositories as local snapshots: `org/name[@revision]` resolved in the Hugging Face cache (or
downloaded into it), with the cache's refs and snapshots checked before huggingface_hub follows them."""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from moekit._fs import hub_cache, read_small
from moekit.errors import AssetError

HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "README.md"]  # no pickles, no code


def resolve_hub(repo: str, log: Callable[[str], None] | None = None) -> Path:
    """The local snapshot of Hub repository `org/name[@revision]`: its configs, safetensors weights and
    tokenizer files (never pickles or code), from the Hugging Face cache or downloaded into it. Honours
    HF_HUB_OFFLINE (then only the cache) and the token in the environment (HF_TOKEN)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = repo.partition("@")
    if revision and any(part in ("", ".", "..") for part in revision.split("/")):
        raise AssetError(f"{revision!r} in {repo} is not a revision name: a branch, tag or commit has no empty, "
                         "'.' or '..' parts")
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if log is not None:
        log(f"{'looking up' if offline else 'fetching'} {repo} in the Hugging Face cache {hub_cache()}")
    entry = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    _check_ref(entry / "refs" / (revision or "main"))
    try:
        found = Path(snapshot_download(repo_id, revision=revision or None, cache_dir=hub_cache(),
                                       allow_patterns=HUB_FILES, local_files_only=offline))
    except LocalEntryNotFoundError:
        raise AssetError(_cache_miss(repo_id, revision or "main")) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise AssetError(f"cannot fetch {repo} from the Hugging Face Hub: {' '.join(str(e).split())[:300]}") from None
    snapshots = Path(os.path.realpath(entry / "snapshots"))
    if snapshots not in Path(os.path.realpath(found)).parents:
        raise AssetError(f"{repo} resolved to {found}, outside its cache folder {snapshots}: a damaged or tampered "
                         "Hugging Face cache; download the repository again")
    return found


def _check_ref(ref: Path) -> None:
    """A cache ref (refs/main, refs/<branch>) holds one commit hash in a small regular file: a path, a FIFO or a
    device (reads forever) is refused before huggingface_hub follows it."""
    if not (ref.exists() or ref.is_symlink()):
        return

    commit = read_small(ref, "Hugging Face cache ref", AssetError, limit=256).strip()
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise AssetError(f"{ref} holds {commit[:60]!r}, not a commit hash: a damaged or tampered Hugging Face cache; "
                         "download the repository again")


def _cache_miss(repo_id: str, revision: str) -> str:
    """Why the Hugging Face cache cannot give `repo_id` at `revision` offline: what is wrong in its cache folder."""
    entry = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    ref = entry / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = entry / "snapshots" / commit
    if entry.is_dir() and ref.is_file() and not snapshot.is_dir():
        return (f"{ref} names commit {commit[:40]!r}, whose snapshot {snapshot} is missing (an interrupted or "
                "deleted download); download the repository again")
    dangling = sorted(p.name for p in snapshot.iterdir() if p.is_symlink() and not p.exists()) \
        if snapshot.is_dir() else []
    if dangling:
        return (f"the cached snapshot {snapshot} links {', '.join(dangling[:3])} to blobs that are missing; download "
                "the repository again")
    return (f"{repo_id} is no local directory, and as a Hub repository it is not in the Hugging Face cache "
            f"{hub_cache()} at revision {revision!r} while HF_HUB_OFFLINE is set (or the Hub cannot be reached); "
            "download it first, or unset HF_HUB_OFFLINE")
