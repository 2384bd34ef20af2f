"""A stand-in for a vLLM server on loopback (`VLLM_SERVER_DEV_MODE=1`): the endpoints the server engine calls, every
request recorded, and the faults a real server has: it goes away (connections refused), stalls, and comes back on
the same port."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class VLLMServerStandIn:
    """`server = VLLMServerStandIn(); server.url`; `server.down()` / `server.up()`; `server.stall_for = seconds` delays
    the next completion; `server.hang()` makes every completion and `/health` request wait until `server.release()`
    (a hung server: it accepts connections but never answers); `server.requests`: `"METHOD /path"` in order,
    `server.bodies` their JSON bodies. Completions are `completion` (token ids, log-prob -0.5 each), `n` per prompt.
    With a `teacher` model, a request with `prompt_logprobs` is scored as vLLM does: per prompt position (the first
    None), the top `prompt_logprobs` tokens by rank and the position's own token, log-probs of the model's logits
    divided by `temperature`, and prompts with token ids beyond its vocabulary are refused as vLLM does."""

    def __init__(self, completion=(7, 8, 9), world_size=1, teacher=None):
        self.completion, self.world_size, self.teacher = list(completion), world_size, teacher
        self.requests, self.bodies, self.stall_for = [], [], 0.0
        self.answering, self.hang_after = threading.Event(), None
        self.answering.set()
        self.server, self.port = None, 0
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hang(self, after: int = 0) -> None:
        """Hang from now on, or once `after` more completion requests have been answered."""
        self.hang_after = after
        if after == 0:
            self.answering.clear()

    def release(self) -> None:
        self.answering.set()

    def down(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()  # the port refuses connections until up()

    def _answer(self, method: str, path: str, body: dict | None):
        if path in ("/v1/completions", "/health"):
            self.answering.wait(timeout=120)  # a hung server (`hang()`): no answer until `release()`
        self.requests.append(f"{method} {path}")
        self.bodies.append(body)
        if path == "/v1/models":
            return {"data": [{"id": "stand-in", "max_model_len": 512}]}
        if path == "/get_world_size":
            return {"world_size": self.world_size}
        if path == "/v1/completions" and self.teacher is not None:  # vLLM's check of the prompt's token ids
            largest = max(max(ids) for ids in body["prompt"])
            if largest >= self.teacher.config.vocab_size:
                return 400, {"error": {"message": f"Token id {largest} is out of vocabulary"}}
        if path == "/v1/completions" and body.get("prompt_logprobs") is not None:
            return {"choices": [self._score(i, ids, body) for i, ids in enumerate(body["prompt"])]}
        if path == "/v1/completions":
            if self.hang_after is not None:
                self.hang_after -= 1
                if self.hang_after <= 0:
                    self.answering.clear()  # the next request hangs
            if self.stall_for:
                stall, self.stall_for = self.stall_for, 0.0
                time.sleep(stall)
            choices = [
                {
                    "index": i,
                    "token_ids": self.completion,
                    "logprobs": {"token_logprobs": [-0.5] * len(self.completion)},
                }
                for i in range(body.get("n", 1) * len(body["prompt"]))
            ]
            return {"choices": choices}
        if path.startswith("/server_info"):
            return {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}
        return {}

    def _score(self, index: int, ids: list[int], body: dict) -> dict:
        import torch

        with torch.no_grad():
            logits = self.teacher(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        log_probs = torch.log_softmax(logits / body.get("temperature", 1.0), dim=-1)
        ranks = log_probs.argsort(dim=-1, descending=True).argsort(dim=-1) + 1
        positions = [None]
        for position, token in enumerate(ids[1:]):
            row, k = log_probs[position], body["prompt_logprobs"]
            chosen = {*row.topk(k).indices.tolist(), token}
            positions.append({str(t): {"logprob": row[t].item(), "rank": ranks[position, t].item()} for t in chosen})
        return {"index": index, "token_ids": [0], "prompt_logprobs": positions}

    def _handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body):
                status, body = body if isinstance(body, tuple) else (200, body)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply(stand_in._answer("GET", self.path, None))

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._reply(stand_in._answer("POST", self.path, json.loads(raw) if raw else None))

        return Handler
