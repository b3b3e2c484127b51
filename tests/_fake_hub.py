"""A loopback HTTP server speaking the part of the Hugging Face Hub's API that
huggingface_hub's file functions call, for tests that run the real client through
HF_ENDPOINT. Endpoints and headers follow huggingface_hub (hf_api.py, file_download.py,
utils/_http.py of the installed version):

* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=`` -> a JSON list of
  ``{"type": "file"|"directory", "oid", "size", "path", "lfs": {"oid", "size", "pointerSize"}}``
  (list_repo_tree / list_repo_files; one page, so no ``Link: rel="next"`` header).
* ``GET /api/models/{repo}/revision/{rev}`` -> model info with ``sha`` and ``siblings``
  (model_info: dasllama's file list, as snapshot_download's).
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``: small files answer 200 with ``ETag`` (the
  git blob id), ``X-Repo-Commit`` and ``Content-Length``; LFS files answer 302 to a CDN
  URL on a second loopback server (another origin, as the Hub's CDN is: the client
  stops at the redirect and drops the Authorization header) with ``X-Linked-Etag`` (the sha256), ``X-Linked-Size``,
  ``X-Repo-Commit`` and ``Location``, like huggingface.co.
* ``GET /cdn/{sha256}``: the bytes, with ``Range: bytes=N-`` answered 206 + Content-Range.
* Errors carry ``X-Error-Code`` the way the client maps them: ``RepoNotFound`` (401),
  ``GatedRepo`` (401 without a token that has access), ``RevisionNotFound`` (404),
  ``EntryNotFound`` (404, with X-Repo-Commit).

Faults for tests: ``drop_after[sha256] = n`` sends the full Content-Length but closes the
connection after n body bytes, once.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote, urlsplit

LFS_MIN = 1024  # files at least this big are served as LFS (redirect to the CDN), smaller ones inline


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: Dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated_token: Optional[str] = None  # set: gated, only this bearer token has access
    revisions: Tuple[str, ...] = ("main",)


@dataclass
class FakeHub:
    repos: Dict[str, Repo] = field(default_factory=dict)
    drop_after: Dict[str, int] = field(default_factory=dict)
    log: List[Tuple[str, str, Optional[str], Optional[str]]] = field(default_factory=list)  # method, path, Range, auth
    _server: Optional[ThreadingHTTPServer] = None
    _cdn_server: Optional[ThreadingHTTPServer] = None
    _blobs: Dict[str, bytes] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, files: Dict[str, bytes], **kw) -> Repo:
        r = Repo(dict(files), **kw)
        self.repos[repo_id] = r
        for data in files.values():
            self._blobs[hashlib.sha256(data).hexdigest()] = data
        return r

    def start(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        servers = []
        for _ in range(2):  # the Hub, and the CDN its LFS redirects point to
            srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # loopback only
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append(srv)
        self._server, self._cdn_server = servers
        return self

    @property
    def cdn_url(self) -> str:
        host, port = self._cdn_server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        for srv in (self._server, self._cdn_server):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        self._server = self._cdn_server = None

    # ---- handlers ---------------------------------------------------------------------

    def _send(self, h, status: int, headers: Dict[str, str], body: bytes = b"", head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str, message: str, head: bool, extra: Optional[Dict[str, str]] = None):
        body = json.dumps({"error": message}).encode()
        hdrs = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
        hdrs.update(extra or {})
        self._send(h, status, hdrs, body, head)

    def _access(self, h, repo_id: str, head: bool, files_call: bool) -> Optional[Repo]:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound", "Repository not found", head)
            return None
        if files_call and repo.gated_token is not None:
            auth = h.headers.get("Authorization") or ""
            if auth != f"Bearer {repo.gated_token}":
                self._error(h, 401, "GatedRepo",
                            f"Access to model {repo_id} is restricted. You must have access to it and be "
                            f"authenticated to access it. Please log in.", head)
                return None
        return repo

    def _handle(self, h, head: bool) -> None:
        parts = urlsplit(h.path)
        path = unquote(parts.path)
        self.log.append(("HEAD" if head else "GET", path, h.headers.get("Range"), h.headers.get("Authorization")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
        if m:
            return self._tree(h, m.group(1), m.group(2), m.group(3) or "", parts.query, head)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
        if m:
            return self._info(h, m.group(1), m.group(2), head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(h, m.group(1), m.group(2), m.group(3), head)
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
        if m:
            return self._cdn(h, m.group(1), head)
        self._error(h, 404, "NotFound", f"no route {path}", head)

    def _tree(self, h, repo_id, rev, sub, query, head):
        repo = self._access(h, repo_id, head, files_call=False)  # the tree of a gated repo is public
        if repo is None:
            return
        if rev not in repo.revisions and rev != repo.commit:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        recursive = "recursive=True" in query or "recursive=true" in query
        prefix = sub.rstrip("/") + "/" if sub else ""
        entries, dirs = [], set()
        for p, data in sorted(repo.files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            for i in range(rest.count("/")):
                dirs.add(prefix + "/".join(rest.split("/")[: i + 1]))
            e = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": p}
            if len(data) >= LFS_MIN:
                e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(e)
        out = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)] + entries
        self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(out).encode(), head)

    def _info(self, h, repo_id, rev, head):
        repo = self._access(h, repo_id, head, files_call=False)
        if repo is None:
            return
        if rev not in repo.revisions and rev != repo.commit:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        body = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                "gated": "manual" if repo.gated_token else False,
                "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
        self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(body).encode(), head)

    def _resolve(self, h, repo_id, rev, file, head):
        repo = self._access(h, repo_id, head, files_call=True)
        if repo is None:
            return
        if rev not in repo.revisions and rev != repo.commit:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        data = repo.files.get(file)
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{file} does not exist on \"{rev}\"", head,
                               {"X-Repo-Commit": repo.commit})
        common = {"X-Repo-Commit": repo.commit, "ETag": f'"{git_blob_id(data)}"', "Accept-Ranges": "bytes"}
        if len(data) >= LFS_MIN:
            sha = hashlib.sha256(data).hexdigest()
            loc = f"{self.cdn_url}/cdn/{sha}"
            self._send(h, 302, {**common, "Location": loc, "X-Linked-Etag": f'"{sha}"',
                                "X-Linked-Size": str(len(data)), "Content-Type": "text/plain"},
                       b"Found. Redirecting to " + loc.encode(), head)
        else:
            self._send(h, 200, {**common, "Content-Type": "application/octet-stream"}, data, head)

    def _cdn(self, h, sha, head):
        data = self._blobs.get(sha)
        if data is None:
            return self._error(h, 404, "NotFound", "no such object", head)
        start = 0
        rng = h.headers.get("Range")
        status, hdrs = 200, {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                             "ETag": f'"{sha}"'}
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= len(data):
                return self._send(h, 416, {"Content-Range": f"bytes */{len(data)}"}, b"", head)
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(data) - 1
            data_out = data[start:end + 1]
            status = 206
            hdrs["Content-Range"] = f"bytes {start}-{start + len(data_out) - 1}/{len(data)}"
        else:
            data_out = data
        hdrs["Content-Length"] = str(len(data_out))
        drop = self.drop_after.pop(sha, None) if not head else None
        if drop is not None and drop < len(data_out):
            h.send_response(status)
            for k, v in hdrs.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data_out[:drop])
            h.wfile.flush()
            h.close_connection = True
            try:
                import socket

                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self._send(h, status, hdrs, data_out, head)
