"""A stand-in for the Hugging Face Hub's upload API, on 127.0.0.1 only, for the publishing tests.

It answers the requests huggingface_hub makes for `create_repo` and `upload_folder` (repository creation, the
pre-upload question of how each file goes, the commit with the files inline) and keeps what arrives: every request
(method, path, whether a token came) and each committed file's bytes, so a test compares them with the folder.
It serves from a daemon thread and shuts itself down after `lifetime_s` seconds, so a test that hangs or forgets
it leaves nothing running. Point huggingface_hub at it with HF_ENDPOINT=hub.url.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubStandin:
    def __init__(self, lifetime_s: float = 120.0):
        self.requests: list[dict] = []
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "files": {path: bytes}, "commits": int}
        self.cards: list[str] = []  # README.md texts sent for validation
        self.refuse_commits = 0  # the next N commits answer 403 (huggingface_hub retries a 5xx by itself)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    def __enter__(self):
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_GET(self):
                hub._record(self, b"")
                self._reply(404, {"error": f"not served by the stand-in: {self.path}"})

            def do_POST(self):
                body = self._body()
                hub._record(self, body)
                status, answer = hub._answer(self.path, body)
                self._reply(status, answer)

        return Handler

    def _record(self, handler, body: bytes) -> None:
        self.requests.append(
            {
                "method": handler.command,
                "path": handler.path,
                "token": handler.headers.get("Authorization", "").startswith("Bearer "),
                "bytes": len(body),
            }
        )

    def _answer(self, path: str, body: bytes) -> tuple[int, dict]:
        if path == "/api/repos/create":
            request = json.loads(body)
            repo_id = (
                f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            )
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            private = request.get("visibility", "private" if request.get("private") else "public") == "private"
            self.repos[repo_id] = {"private": private, "files": {}, "commits": 0}
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        if path == "/api/validate-yaml":  # the Hub checks a README's metadata before the commit; kept, not judged
            self.cards.append(json.loads(body)["content"])
            return 200, {}
        parts = path.split("/")  # /api/models/ORG/NAME/preupload/main, /api/models/ORG/NAME/commit/main
        if len(parts) >= 7 and parts[1:3] == ["api", "models"]:
            repo_id, action = f"{parts[3]}/{parts[4]}", parts[5]
            if repo_id not in self.repos:
                return 404, {"error": "Repository not found"}
            if action == "preupload":
                files = json.loads(body)["files"]
                return 200, {
                    "files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                }
            if action == "commit":
                return self._commit(repo_id, body)
        return 404, {"error": f"not served by the stand-in: {path}"}

    def _commit(self, repo_id: str, body: bytes) -> tuple[int, dict]:
        if self.refuse_commits:
            self.refuse_commits -= 1
            return 403, {"error": "the stand-in refused this commit on purpose"}
        repo = self.repos[repo_id]
        for line in body.decode().splitlines():
            entry = json.loads(line)
            if entry["key"] == "file":
                value = entry["value"]
                repo["files"][value["path"]] = base64.b64decode(value["content"])
        repo["commits"] += 1
        oid = f"{repo['commits']:040x}"
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
