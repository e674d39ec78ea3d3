"""A fake Hugging Face Hub on 127.0.0.1, so that tests fill a Hugging Face cache the way users' caches are filled:
by huggingface_hub itself (`snapshot_download`), which writes `models--ORG--NAME/{blobs,snapshots,refs}` with the
snapshot files as relative symbolic links into `blobs/`. Test infrastructure, never used by moekit itself.

It serves local directories as repositories at one commit each, with the few endpoints `snapshot_download` asks:
the revision info (`/api/models/ORG/NAME/revision/REV`), the file tree (`/api/models/ORG/NAME/tree/REV`) and the
files (`/ORG/NAME/resolve/REV/FILE`, HEAD and GET, with the commit and ETag headers the client checks). Given an
`uploads` directory it also takes pushes (`create_repo`, `upload_folder`, `push_to_hub`): the repository creation
(`/api/repos/create`), the README's YAML check (`/api/validate-yaml`), the upload modes
(`/api/models/ORG/NAME/preupload/main`: every file "regular", sent inline) and the commit
(`/api/models/ORG/NAME/commit/main`), whose files it writes into `uploads`/ORG/NAME and serves from then on.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def commit_of(repo: str) -> str:
    """The 40-hex commit a repository is served at (stable per repository id)."""
    return hashlib.sha1(f"commit:{repo}".encode()).hexdigest()


def _blob_id(data: bytes) -> str:
    """git's blob id: what the Hub reports as a file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    repos: dict[str, Path] = {}
    uploads: Path | None = None

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(code)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, data, head: bool = False) -> None:
        self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"}, head)

    def _files(self, repo: str) -> dict[str, bytes]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        for repo in self.repos:
            m = re.fullmatch(rf"/api/models/{re.escape(repo)}/(revision|tree)/([^/]+)(/.*)?", path)
            if m and m.group(2) in ("main", commit_of(repo)):
                files = self._files(repo)
                if m.group(1) == "revision":
                    return self._json({"id": repo, "modelId": repo, "sha": commit_of(repo), "private": False,
                                       "siblings": [{"rfilename": f} for f in files]}, head)
                return self._json([{"type": "file", "oid": _blob_id(d), "size": len(d), "path": f}
                                   for f, d in files.items()], head)
            m = re.fullmatch(rf"/{re.escape(repo)}/resolve/([^/]+)/(.+)", path)
            if m and m.group(1) in ("main", commit_of(repo)):
                data = self._files(repo).get(m.group(2))
                if data is None:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                return self._send(200, data, {"X-Repo-Commit": commit_of(repo), "ETag": f'"{_blob_id(data)}"',
                                              "Content-Type": "application/octet-stream"}, head)
        self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_POST(self) -> None:
        path = unquote(urlsplit(self.path).path)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.uploads is None:
            return self._send(403, b"", {"X-Error-Message": "this fake Hub takes no uploads"})
        if path == "/api/repos/create":
            data = json.loads(body)
            repo = "/".join(filter(None, (data.get("organization"), data["name"])))
            self.repos.setdefault(repo, self.uploads / repo).mkdir(parents=True, exist_ok=True)
            return self._json({"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
        if path == "/api/validate-yaml":
            return self._json({"errors": [], "warnings": []})
        m = re.fullmatch(r"/api/models/(.+)/(preupload|commit)/main", path)
        if not m or m.group(1) not in self.repos:
            return self._send(404, b"", {"X-Error-Code": "RepoNotFound"})
        repo = m.group(1)
        if m.group(2) == "preupload":
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in json.loads(body)["files"]]})
        for item in map(json.loads, body.splitlines()):
            if item["key"] == "file":
                target = self.repos[repo] / item["value"]["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(item["value"]["content"]))
        self._json({"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{commit_of(repo)}",
                    "commitOid": commit_of(repo), "pullRequestUrl": None})


@contextlib.contextmanager
def fake_hub(repos: dict[str, Path], uploads: Path | None = None) -> Iterator[str]:
    """Serve {repository id: local directory} on 127.0.0.1; yields the endpoint URL (for HF_ENDPOINT or
    `snapshot_download(endpoint=...)`). `uploads`: where pushed repositories are written (None: pushes are
    refused). The server stops when the block ends."""
    handler = type("Handler", (_Handler,), {"repos": dict(repos), "uploads": uploads})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def download(cache: Path, repos: dict[str, Path]) -> Path:
    """Fill the Hugging Face cache `cache` (use as HF_HUB_CACHE) with `repos`, downloaded by huggingface_hub's own
    snapshot_download from a fake Hub; returns `cache`."""
    from huggingface_hub import constants, snapshot_download

    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False  # read from the environment at import
    try:
        with fake_hub(repos) as endpoint:
            for repo in repos:
                snapshot_download(repo, cache_dir=cache, endpoint=endpoint, etag_timeout=10)
    finally:
        constants.HF_HUB_OFFLINE = offline
    return Path(cache)
