"""A stand-in for the Hugging Face Hub on loopback: the endpoints push_to_hub uses, recording every upload."""

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubStandIn:
    """`with HubStandIn() as hub:` serves on http://127.0.0.1:<port>; `hub.files[repo_id][path]` holds the bytes."""

    def __init__(self):
        self.files: dict[str, dict[str, bytes]] = {}
        self.requests: list[str] = []
        self.headers_seen: list[dict] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body=None, headers=None):
                data = json.dumps(body if body is not None else {}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self):
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_POST(self):
                hub.requests.append(f"POST {self.path}")
                hub.headers_seen.append(dict(self.headers))
                body, parts = self._body(), self.path.split("?")[0].strip("/").split("/")
                if self.path.startswith("/api/repos/create"):
                    request = json.loads(body)
                    repo_id = f"{request.get('organization') or 'tester'}/{request['name']}"
                    exists = repo_id in hub.files
                    hub.files.setdefault(repo_id, {})
                    return self._send(409 if exists else 200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                if self.path.startswith("/api/validate-yaml"):
                    return self._send(200, {"errors": [], "warnings": []})
                if len(parts) >= 6 and parts[0] == "api" and parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(
                        200,
                        {
                            "files": [
                                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                            ]
                        },
                    )
                if len(parts) >= 6 and parts[0] == "api" and parts[4] == "commit":
                    repo_id = f"{parts[2]}/{parts[3]}"
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            hub.files.setdefault(repo_id, {})[item["value"]["path"]] = base64.b64decode(
                                item["value"]["content"]
                            )
                    oid = hashlib.sha1(body).hexdigest()
                    return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid})
                return self._send(404, {"error": f"not handled: {self.path}"})

            def do_GET(self):
                hub.requests.append(f"GET {self.path}")
                parts = self.path.split("?")[0].strip("/").split("/")
                if self.path.startswith("/api/whoami"):
                    return self._send(
                        200, {"name": "tester", "type": "user", "orgs": [], "auth": {"accessToken": {"role": "write"}}}
                    )
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo_id = f"{parts[2]}/{parts[3]}"
                    if repo_id not in hub.files:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    siblings = [{"rfilename": p} for p in hub.files[repo_id]]
                    return self._send(200, {"id": repo_id, "sha": "0" * 40, "siblings": siblings, "private": False})
                return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
