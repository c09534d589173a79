"""A small local stand-in for the HuggingFace hub, for the upload tests (127.0.0.1 only, in memory).

It implements just the endpoints huggingface_hub's HfApi uses to create a repository and branch, upload a
folder (preupload → LFS batch/PUT/verify → ndjson commit; HF_HUB_DISABLE_XET=1 keeps the client on LFS)
and download it back (repo info, tree, resolve). It records every request (method, path, auth header) so
tests can check what was sent, and can fail one endpoint on demand to test error handling.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse

USER = "tester"
LFS_SUFFIXES = (".safetensors", ".png", ".bin")  # stored through the LFS path, like the real hub's defaults


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})  # branch → head commit id
    lfs_files: set[str] = field(default_factory=set)  # paths committed as LFS pointers


@dataclass
class Hub:
    token: str
    repos: dict[str, Repo] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Authorization)
    fail_on: str | None = None  # fail requests whose path contains this (500 with a message)
    corrupt_download: str | None = None  # serve this file with its last byte flipped
    url: str = ""


class _Handler(BaseHTTPRequestHandler):
    hub: Hub

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    # --- plumbing -----------------------------------------------------------------------------------
    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: Any = None, headers: dict[str, str] | None = None,
              raw: bytes | None = None) -> None:
        body = raw if raw is not None else json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self._send(401, {"error": "Invalid credentials in Authorization header"})
        return False

    def _route(self) -> None:
        path = unquote(urlparse(self.path).path)
        self.hub.requests.append((self.command, path, self.headers.get("Authorization", "")))
        if self.hub.fail_on and self.hub.fail_on in path:
            self._body()
            self._send(500, {"error": f"simulated server failure at {path}"})
            return
        for method, pattern, handler in ROUTES:
            match = re.fullmatch(pattern, path)
            if method == self.command and match:
                handler(self, *match.groups())
                return
        self._send(404, {"error": f"no route for {self.command} {path}"})

    do_GET = do_POST = do_PUT = do_HEAD = _route

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._send(404, {"error": f"Repository {repo_id} not found"}, {"X-Error-Code": "RepoNotFound"})
        return repo

    # --- endpoints ------------------------------------------------------------------------------------
    def create_repo(self) -> None:
        if not self._authorized():
            return
        body = json.loads(self._body())
        repo_id = f"{body.get('organization') or USER}/{body['name']}"
        if repo_id in self.hub.repos:
            self._send(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"})
            return
        self.hub.repos[repo_id] = Repo(private=body.get("visibility", "private" if body.get("private") else "public")
                                       == "private")
        self._send(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def create_branch(self, repo_id: str, branch: str) -> None:
        if not self._authorized() or not (repo := self._repo(repo_id)):
            return
        self._body()
        repo.branches.setdefault(branch, dict(repo.branches["main"]))
        repo.commits.setdefault(branch, repo.commits["main"])
        self._send(200, {})

    def validate_yaml(self) -> None:
        self._body()
        self._send(200, {"errors": [], "warnings": []})

    def preupload(self, repo_id: str, revision: str) -> None:
        if not self._authorized() or not self._repo(repo_id):
            return
        files = json.loads(self._body())["files"]
        modes = [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular",
                  "shouldIgnore": False} for f in files]
        self._send(200, {"files": modes, "commitOid": self.hub.repos[repo_id].commits.get(revision)})

    def lfs_batch(self, repo_id: str) -> None:
        if not self._authorized() or not self._repo(repo_id):
            return
        objects = json.loads(self._body())["objects"]
        self._send(200, {"transfer": "basic", "objects": [
            {"oid": o["oid"], "size": o["size"], "authenticated": True,
             "actions": {"upload": {"href": f"{self.hub.url}/lfs-store/{o['oid']}"},
                         "verify": {"href": f"{self.hub.url}/lfs-verify"}}} for o in objects]})

    def lfs_put(self, oid: str) -> None:
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            self._send(400, {"error": "content does not match its sha256"})
            return
        self.hub.lfs[oid] = data
        self._send(200, {})

    def lfs_verify(self) -> None:
        if not self._authorized():
            return
        obj = json.loads(self._body())
        ok = obj["oid"] in self.hub.lfs and len(self.hub.lfs[obj["oid"]]) == obj["size"]
        self._send(200 if ok else 404, {} if ok else {"error": "object not uploaded"})

    def commit(self, repo_id: str, revision: str) -> None:
        if not self._authorized() or not (repo := self._repo(repo_id)):
            return
        files = repo.branches.setdefault(revision, {})
        for line in self._body().decode().splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
                repo.lfs_files.discard(value["path"])
            elif item["key"] == "lfsFile":
                files[value["path"]] = self.hub.lfs[value["oid"]]
                repo.lfs_files.add(value["path"])
            elif item["key"] == "deletedFile":
                files.pop(value["path"], None)
        commit = hashlib.sha1(json.dumps(sorted((p, hashlib.sha256(b).hexdigest()) for p, b in files.items()))
                              .encode()).hexdigest()
        repo.commits[revision] = commit
        self._send(200, {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{commit}", "commitOid": commit,
                         "success": True})

    def _resolve(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
        repo = self._repo(repo_id)
        if repo is None or (repo.private and not self._authorized()):
            return None
        branch = next((b for b, c in repo.commits.items() if revision in (b, c)), None)
        if branch is None:
            self._send(404, {"error": f"Revision {revision} not found"}, {"X-Error-Code": "RevisionNotFound"})
            return None
        return repo, branch

    def repo_info(self, repo_id: str, revision: str) -> None:
        if not (found := self._resolve(repo_id, revision)):
            return
        repo, branch = found
        self._send(200, {"id": repo_id, "modelId": repo_id, "sha": repo.commits[branch], "private": repo.private,
                         "siblings": [{"rfilename": p} for p in sorted(repo.branches[branch])]})

    def tree(self, repo_id: str, revision: str) -> None:
        if not (found := self._resolve(repo_id, revision)):
            return
        repo, branch = found
        entries = []
        for path, data in sorted(repo.branches[branch].items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            if path in repo.lfs_files:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
            entries.append(entry)
        self._send(200, entries)

    def resolve(self, repo_id: str, revision: str, path: str) -> None:
        if not (found := self._resolve(repo_id, revision)):
            return
        repo, branch = found
        data = repo.branches[branch].get(path)
        if data is None:
            self._send(404, {"error": f"{path} not found"}, {"X-Error-Code": "EntryNotFound"})
            return
        if path == self.hub.corrupt_download:
            data = data[:-1] + bytes([data[-1] ^ 1])
        headers = {"X-Repo-Commit": repo.commits[branch], "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        if path in repo.lfs_files:
            headers.update({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))})
        self._send(200, raw=data, headers=headers)


_REPO = r"([^/]+/[^/]+)"
ROUTES = [
    ("POST", r"/api/repos/create", _Handler.create_repo),
    ("POST", rf"/api/models/{_REPO}/branch/(.+)", _Handler.create_branch),
    ("POST", r"/api/validate-yaml", _Handler.validate_yaml),
    ("POST", rf"/api/models/{_REPO}/preupload/(.+)", _Handler.preupload),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", _Handler.lfs_batch),
    ("PUT", r"/lfs-store/([0-9a-f]{64})", _Handler.lfs_put),
    ("POST", r"/lfs-verify", _Handler.lfs_verify),
    ("POST", rf"/api/models/{_REPO}/commit/(.+)", _Handler.commit),
    ("GET", rf"/api/models/{_REPO}", lambda handler, repo_id: handler.repo_info(repo_id, "main")),
    ("GET", rf"/api/models/{_REPO}/revision/(.+)", _Handler.repo_info),
    ("GET", rf"/api/models/{_REPO}/tree/([^/]+)", _Handler.tree),
    ("GET", rf"/{_REPO}/resolve/([^/]+)/(.+)", _Handler.resolve),
    ("HEAD", rf"/{_REPO}/resolve/([^/]+)/(.+)", _Handler.resolve),
]


class HubServer:
    """``with HubServer(token) as hub:`` serves on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, token: str):
        self.hub = Hub(token=token)
        handler = type("Handler", (_Handler,), {"hub": self.hub})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.hub.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Hub:
        self.thread.start()
        return self.hub

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
