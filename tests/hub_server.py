"""HTTP servers on 127.0.0.1 for the download, upload and remote-shard tests: a Hugging Face
hub endpoint serving files a test made and taking the commits ``HfApi`` pushes, and a file
server whose shards can break.

Nothing leaves the machine: tests point ``HF_ENDPOINT`` or a shard URL at these.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:  # noqa: N802 (the http.server protocol)
        self.respond(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self.respond(body=True)

    def do_POST(self) -> None:  # noqa: N802
        try:
            self.take(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except (BrokenPipeError, ConnectionResetError):
            pass

    def send_json(self, status: int, value: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        for name, text in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, text)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def take(self, body: bytes) -> None:
        """The hub's write API as ``HfApi`` calls it: ``/api/repos/create``, then per commit
        ``/api/models/<repo>/preupload/<revision>`` (every file answered ``regular``, so its
        bytes come base64 in the commit) and ``/api/models/<repo>/commit/<revision>`` (NDJSON:
        a header, then the files)."""
        path = self.path.split("?", 1)[0]
        self.server.requests.append((self.command, self.path))
        if path in self.server.fail:
            self.send_json(self.server.fail[path], {"error": "the test's hub fails this request"})
            return
        if (self.server.token is not None
                and self.headers.get("Authorization") != f"Bearer {self.server.token}"):
            self.send_json(401, {"error": "Invalid username or password."})
            return
        if path == "/api/repos/create":
            asked = json.loads(body)
            repo_id = f"{asked.get('organization') or self.server.user}/{asked['name']}"
            url = {"url": f"{self.server.url}/{repo_id}"}
            if repo_id in self.server.hub:
                self.send_json(409, {"error": "You already created this model repo", **url})
                return
            self.server.hub[repo_id] = {}
            self.server.created[repo_id] = {
                "private": bool(asked.get("private")) or asked.get("visibility") == "private"}
            self.send_json(200, url)
            return
        parts = path.strip("/").split("/")  # api/models/<org>/<name>/<call>/<revision>
        if len(parts) != 6 or parts[:2] != ["api", "models"] or \
                parts[4] not in ("preupload", "commit"):
            self.send_json(404, {"error": f"the test's hub has no {path}"})
            return
        repo_id = "/".join(parts[2:4])
        if repo_id not in self.server.hub:
            self.send_json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return
        if parts[4] == "preupload":
            files = json.loads(body)["files"]
            self.send_json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                            "shouldIgnore": False} for f in files]})
            return
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header, items = lines[0]["value"], lines[1:]
        added = {item["value"]["path"]: base64.b64decode(item["value"]["content"])
                 for item in items if item["key"] == "file"}
        if len(added) != len(items):  # only files said regular: no LFS pointers, no deletions
            self.send_json(400, {"error": f"the test's hub takes files only, got {items}"})
            return
        self.server.hub[repo_id].update(added)
        self.server.commits.append({"repo": repo_id, "summary": header["summary"],
                                    "revision": parts[5], "files": sorted(added)})
        self.send_json(200, {"commitUrl": f"{self.server.url}/{repo_id}/commit/{COMMIT}",
                             "commitOid": COMMIT, "pullRequestUrl": None})

    def respond(self, body: bool) -> None:
        try:
            self.answer(body)
        except (BrokenPipeError, ConnectionResetError):  # the reader left (a slow or endless
            pass                                          # body, given up on)

    def answer(self, body: bool) -> None:
        self.server.requests.append((self.command, self.path))
        if self.path in self.server.hang:
            time.sleep(3600)  # a server that never answers
        if self.path in self.server.fail:  # a store that fails this file every time
            self.send_response(self.server.fail[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path in self.server.endless:  # a body that never ends (no length said)
            self.send_response(200)
            self.end_headers()
            while body:
                self.wfile.write(self.server.endless[self.path])
        found = self.server.find(self.path)
        if found is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data, status = found, 200
        cut = self.server.cut_once.pop(self.path, None) if body else None
        etag = hashlib.sha256(data).hexdigest()
        asked = self.headers.get("Range", "")
        if asked and self.path in self.server.replaced_on_range:
            # a resumed read answered with the whole of another object, as 200
            data = self.server.replaced_on_range[self.path]
            etag = hashlib.sha256(data).hexdigest()
        elif asked.startswith("bytes=") and asked.endswith("-") and self.server.ranges:
            start = int(asked[len("bytes="):-1])
            self.server.ranges_served.append((self.path, start))
            data, status = data[start:], 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body and self.path in self.server.drip:  # a byte at a time, for ever or nearly
            for position in range(len(data)):
                self.wfile.write(data[position:position + 1])
                self.wfile.flush()
                time.sleep(self.server.drip[self.path])
        elif body:
            self.wfile.write(data if cut is None else data[:cut])
            self.wfile.flush()
            if cut is not None:
                self.close_connection = True


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub: dict[str, dict[str, bytes]] = {}  # repo id -> file name -> bytes
        self.folder: Path | None = None  # served at /files/<name>
        self.cut_once: dict[str, int] = {}  # path -> bytes sent before the connection drops
        self.hang: set[str] = set()
        self.fail: dict[str, int] = {}  # path -> the HTTP status it always gets
        self.drip: dict[str, float] = {}  # path -> seconds between its body's bytes
        self.endless: dict[str, bytes] = {}  # path -> a chunk its body repeats for ever
        self.replaced_on_range: dict[str, bytes] = {}  # path -> the body a Range request gets
        self.ranges = True  # honour "Range: bytes=N-" (a resumed read)
        self.ranges_served: list[tuple[str, int]] = []
        self.requests: list[tuple[str, str]] = []
        # uploads: the token every write must carry (None: none asked), the namespace of a
        # repository created without one, what each creation asked, the commits taken
        self.token: str | None = None
        self.user = "mmgoal-test-user"
        self.created: dict[str, dict] = {}  # repo id -> {"private": bool}
        self.commits: list[dict] = []  # {"repo", "summary", "revision", "files"}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def find(self, path: str) -> bytes | None:
        path = path.split("?", 1)[0]
        if path.startswith("/files/") and self.folder is not None:
            file = self.folder / path.removeprefix("/files/")
            return file.read_bytes() if file.is_file() else None
        # /<org>/<name>/resolve/<revision>/<file>
        parts = path.strip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.hub.get("/".join(parts[:2]), {}).get("/".join(parts[4:]))
        return None


def client_env(server: _Server, hf_home: Path, token: str | None = None) -> dict[str, str]:
    """The environment of a process that talks to ``server`` as its hub: online (the tests set
    HF_HUB_OFFLINE, which huggingface_hub reads when imported: a fresh process),
    ``HF_ENDPOINT`` the server's, ``HF_HOME`` an empty folder (no token saved on this
    machine is read), ``HF_TOKEN`` ``token`` (None: no token)."""
    unset = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=server.url)
    if token is not None:
        env["HF_TOKEN"] = token
    return env


@contextmanager
def serving() -> Iterator[_Server]:
    """A server on 127.0.0.1 for the length of the block (a thread of this process)."""
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
