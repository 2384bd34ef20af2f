"""vLLM's server mode (`vllm_mode="server"`): a separately started OpenAI-compatible vLLM server, reached over HTTP
(token ids in, token ids and log-probs out); weight sync, and faults, as docs/vllm.md ("Modes", "Faults") describes."""

import contextlib
import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from typing import Any

import torch

from ..models.loading import base_model
from .vllm_engine import VLLMEngine, engine_generation_kwargs, group_runs, named_weights, write_checkpoint


logger = logging.getLogger(__name__)

_UNREACHABLE = (ConnectionError, TimeoutError, OSError, http.client.HTTPException)  # an HTTP error status is handled


class RequestAborted(RuntimeError):
    """A request stopped by `abort_requests` (its thread is being stopped): never retried."""


class ServerConnection:
    """HTTP to one OpenAI-compatible vLLM server, as every caller needs it: `/health` polled until it answers,
    requests retried with backoff while the server is unreachable (up to `timeout` seconds, then an error naming the
    URL, `context()` (where training stands) and the remedy), `recover()` called once it is back (a policy server
    reloads its last weights), and the request in flight of a thread abortable from another (`abort_requests`)."""

    def __init__(self, base_url: str, timeout: float, context=lambda: "", recover=lambda: None, start_hint: str = ""):
        self.base_url, self.timeout, self.context, self.recover = base_url.rstrip("/"), timeout, context, recover
        self.start_hint = start_hint
        # The connection each thread has open (a producer's request can be aborted from the thread stopping it), and
        # the threads whose requests were aborted: their next attempt raises instead of retrying.
        self._connections: dict[threading.Thread, http.client.HTTPConnection] = {}
        self._aborted: set[threading.Thread] = set()
        self._connections_lock = threading.Lock()

    def wait_until_up(self, timeout: float, phase: str) -> None:
        deadline, delay = time.monotonic() + timeout, 0.5
        while True:
            if self.responsive(timeout=5):
                return
            if time.monotonic() >= deadline:
                hint = f" {self.start_hint}" if phase == "start-up" and self.start_hint else ""
                raise ConnectionError(
                    f"The vLLM server at {self.base_url} did not answer /health within vllm_server_timeout={timeout}s "
                    f"({phase}{self.context()}).{hint}"
                )
            self.check_not_aborted()
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

    def responsive(self, timeout: float) -> bool:
        """`/health` answers 200 within `timeout` seconds."""
        with contextlib.suppress(*_UNREACHABLE):
            return self.exchange("GET", "/health", None, timeout)[0] == 200
        return False

    def exchange(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, str]:
        """`(status, text)` of one HTTP request, on a connection registered for this thread (`abort_requests`)."""
        url = urllib.parse.urlsplit(self.base_url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = kind(url.hostname, url.port, timeout=timeout)
        thread = threading.current_thread()
        with self._connections_lock:
            self._connections[thread] = connection
        try:
            data = json.dumps(body).encode() if body is not None else None
            connection.request(method, url.path + path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            with self._connections_lock:
                self._connections.pop(thread, None)
            connection.close()

    def abort_requests(self, thread: threading.Thread) -> None:
        """Shut the socket of `thread`'s request in flight (its read fails at once) and mark the thread, so that
        its next attempt raises `RequestAborted` instead of retrying."""
        with self._connections_lock:
            self._aborted.add(thread)
            connection = self._connections.get(thread)
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)

    def check_not_aborted(self) -> None:
        thread = threading.current_thread()
        with self._connections_lock:
            if thread in self._aborted:
                self._aborted.discard(thread)
                raise RequestAborted(f"The request to the vLLM server at {self.base_url} was aborted (stopping).")

    def send(self, method: str, path: str, body: dict | None, timeout: float) -> Any:
        self.check_not_aborted()
        status, text = self.exchange(method, path, body, timeout)
        if status >= 400:
            hint = ""
            if status == 404 and path.split("?")[0] in ("/collective_rpc", "/reset_prefix_cache"):
                hint = " Start the server with VLLM_SERVER_DEV_MODE=1: weight sync needs its /collective_rpc endpoint."
            raise RuntimeError(f"vLLM server {method} {path} failed with HTTP {status}: {text[:500]}.{hint}")
        return json.loads(text) if text else None

    def request(self, method: str, path: str, body: dict | None = None, timeout=None, phase: str = "") -> Any:
        """`send`, retried while the server is unreachable (with backoff, for up to `timeout` seconds); once it
        answers again, `recover()` runs before the retry."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.send(method, path, body, timeout or self.timeout)
            except _UNREACHABLE as error:
                self.check_not_aborted()  # a request aborted while it was in flight: raise, do not retry
                try:
                    if time.monotonic() >= deadline:
                        raise
                    logger.warning(f"vLLM server at {self.base_url} unreachable ({phase}: {error}); retrying.")
                    self.wait_until_up(deadline - time.monotonic(), phase)
                except _UNREACHABLE as gone:
                    raise ConnectionError(
                        f"The vLLM server at {self.base_url} stopped answering {method} {path} ({phase}"
                        f"{self.context()}) and was not back within vllm_server_timeout={self.timeout}s: {error}. "
                        "Restart the server, then resume with `trainer.train(resume_from_checkpoint=True)`."
                    ) from gone
            with contextlib.suppress(*_UNREACHABLE):  # gone again: the next attempt waits for it once more
                self.recover()


class VLLMServerEngine(VLLMEngine):
    """A running OpenAI-compatible vLLM server, reached at `vllm_server_base_url` or `http://host:port`."""

    mode = "server"

    def __init__(self, args, accelerator):
        super().__init__(args, args.vllm_structured_outputs_regex, engine_generation_kwargs(args))
        self.accelerator = accelerator
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        hint = (
            f"Start it first, e.g. `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --port {args.vllm_server_port} "
            "--logprobs-mode processed_logprobs` (docs/vllm.md)."
        )
        self.server = ServerConnection(
            base_url, args.vllm_server_timeout, lambda: self.context(), self._restore_weights, start_hint=hint
        )
        self.base_url = self.server.base_url
        self.weights_dir = os.path.join(os.path.abspath(args.output_dir), "vllm-weights")
        self.transfer = None  # the NCCL weight-transfer group, opened at the first sync (vllm_weight_transfer="nccl")
        self.server.wait_until_up(args.vllm_server_timeout, "start-up")
        self.served_model = self._request("GET", "/v1/models", phase="start-up")["data"][0]["id"]
        if accelerator.is_main_process:
            self._check_logprobs_mode()

    def _check_logprobs_mode(self) -> None:
        """TRL's warning: log-probs before temperature (vLLM's default) bias the importance-sampling correction."""
        try:
            info = self._send("GET", "/server_info?config_format=json", None, 10)
            mode = str(info["vllm_config"]["model_config"]["logprobs_mode"])
        except Exception:  # noqa: BLE001 (an older server without /server_info: nothing to check)
            return
        if "processed_logprobs" not in mode:
            logger.warning(
                f"The vLLM server returns {mode} log-probs; start it with `--logprobs-mode processed_logprobs` so "
                "that they are taken after temperature, as the trainer's (the importance-sampling correction reads "
                "them)."
            )

    # ---------------------------------------------------------------------------------------------------- HTTP
    def responsive(self, timeout: float) -> bool:
        return self.server.responsive(timeout)

    def abort_requests(self, thread: threading.Thread) -> None:
        self.server.abort_requests(thread)

    def _send(self, method: str, path: str, body: dict | None, timeout: float) -> Any:
        return self.server.send(method, path, body, timeout)

    def _request(self, method: str, path: str, body: dict | None = None, timeout=None, phase: str = "") -> Any:
        return self.server.request(method, path, body, timeout, phase)

    def _restore_weights(self) -> None:
        """After the server was unreachable (it may have restarted from its own checkpoint): load the last synced
        weights again, from the folder written at that sync."""
        if self.synced is None or self.args.vllm_weight_transfer != "checkpoint":
            return  # nothing synced yet; NCCL: the trainer re-sends at the next sync (the engine is marked unsynced)
        self._send("POST", "/collective_rpc", self._reload_body(), self.args.weight_sync_timeout)
        self._send("POST", "/reset_prefix_cache", None, self.args.weight_sync_timeout)

    def _reload_body(self) -> dict:
        return {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir, "is_checkpoint_format": True}}

    # ---------------------------------------------------------------------------------------------------- weights
    def sync_weights(self, model, accelerator) -> None:
        """Every process iterates the weights (gathering may be collective) and holds its lock (`ensure_synced`);
        the main process sends them once all do."""
        if self.args.vllm_weight_transfer == "nccl":
            return self._sync_over_nccl(model, accelerator)
        config = getattr(base_model(accelerator.unwrap_model(model)), "config", None)
        write_checkpoint(self.weights_dir, config, named_weights(model, accelerator), accelerator.is_main_process)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            self._reload()
        accelerator.wait_for_everyone()

    def _reload(self) -> None:
        """The server loads the checkpoint folder written at this sync (`reload_weights`) and drops its cache."""
        self._request("POST", "/collective_rpc", self._reload_body(), self.args.weight_sync_timeout, "weight sync")
        self._request("POST", "/reset_prefix_cache", None, self.args.weight_sync_timeout, "weight sync")

    def sync_in_background(self, model, accelerator, owner, version) -> float:
        """One process, checkpoint transfer: the weights are copied to CPU here (the seconds returned), then written
        and reloaded into the server by a thread (the reload under the lock) while training goes on; the engine
        reports the new `version` once the server holds it. Otherwise `ensure_synced`."""
        if accelerator.num_processes > 1 or self.args.vllm_weight_transfer != "checkpoint":
            return super().sync_in_background(model, accelerator, owner, version)
        self.wait_for_sync()
        start = time.perf_counter()
        config = getattr(base_model(accelerator.unwrap_model(model)), "config", None)
        weights = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_weights(model, accelerator)]
        target = lambda: self._load_snapshot(config, weights, (id(owner), version))  # noqa: E731
        self.syncing = threading.Thread(target=target, name="trl_unified-weight-sync", daemon=True)
        self.syncing.start()
        return time.perf_counter() - start

    def _load_snapshot(self, config, weights, synced) -> None:
        try:
            write_checkpoint(self.weights_dir, config, weights, write=True)
            with self.lock:
                self.synced = None
                self._reload()
                self.synced = synced
        except BaseException as error:  # noqa: BLE001 (raised by the next wait_for_sync, or in the producer)
            self.sync_error = error

    def _sync_over_nccl(self, model, accelerator) -> None:
        """TRL 1.16's sequence (`trl/experimental/async_grpo/weight_transfer.py`): the main process broadcasts each
        tensor over the NCCL group while `/update_weights` tells the server what to receive."""
        weights = named_weights(model, accelerator)
        if not accelerator.is_main_process:
            for _ in weights:  # other processes take part in the gathers only
                pass
            accelerator.wait_for_everyone()
            return
        self.transfer = self.transfer or NCCLWeightTransfer(self)
        accelerator.wait_for_everyone()
        self.transfer.send(list(weights))

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()

    # ---------------------------------------------------------------------------------------------------- sampling
    def generate(self, prompt_ids, generation_config, eos_token_ids):
        """Each process sends its own prompts (the server batches concurrent requests): no collective, so processes
        may hold different numbers of prompts (evaluation shards, the tool loop's remaining rows)."""
        if not prompt_ids:
            return [], []
        settings, completions, logprobs = self.sampling_settings(generation_config, eos_token_ids), [], []
        with self.lock:  # no reload while this process's requests run
            for prompts, n in self._requests(group_runs(prompt_ids)):
                body = {
                    "model": self.served_model,
                    "prompt": prompts,
                    "n": n,
                    "return_token_ids": True,
                    "skip_special_tokens": False,
                    **settings,
                }
                response = self._request("POST", "/v1/completions", body, self.args.request_timeout, "generation")
                for choice in sorted(response["choices"], key=lambda c: c["index"]):
                    ids = list(choice["token_ids"])
                    completions.append(torch.tensor(ids, dtype=torch.long))
                    values = (choice.get("logprobs") or {}).get("token_logprobs") or [None] * len(ids)
                    values = [float("nan") if v is None else float(v) for v in values[: len(ids)]]
                    logprobs.append(torch.tensor(values, dtype=torch.float32))
        return completions, logprobs

    def _requests(self, runs: list[tuple[list[int], int]]):
        """`(prompts, n)` per request: consecutive groups of one size together (`n` is per request), at most
        `max_inflight_tasks` completions a request when it is positive."""
        limit, start = self.args.max_inflight_tasks, 0
        while start < len(runs):
            n, end = runs[start][1], start
            while end < len(runs) and runs[end][1] == n and (limit <= 0 or (end - start + 1) * n <= max(limit, n)):
                end += 1
            yield [ids for ids, _ in runs[start:end]], n
            start = end


class NCCLWeightTransfer:
    """The trainer's side of vLLM's NCCL weight-transfer engine (CUDA; vLLM installed in the trainer process)."""

    def __init__(self, engine: VLLMServerEngine):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.utils.network_utils import get_ip, get_open_port

        self.engine, timeout = engine, engine.args.weight_sync_timeout
        world = engine._request("GET", "/get_world_size", phase="weight-transfer set-up")["world_size"]
        info = {
            "master_address": get_ip(),
            "master_port": get_open_port(),
            "rank_offset": 1,
            "world_size": world + 1,  # the server's workers, then this process
            "packed": True,
        }
        self.group = self._alongside(
            lambda: trainer_init(info), "POST", "/init_weight_transfer_engine", {"init_info": info}, timeout
        )

    def send(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        timeout, request = self.engine.args.weight_sync_timeout, self.engine._request
        request("POST", "/pause?mode=keep", None, timeout, "weight sync")
        request("POST", "/start_weight_update", {"is_checkpoint_format": True}, timeout, "weight sync")
        info = {
            "names": [name for name, _ in weights],
            "shapes": [list(t.shape) for _, t in weights],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        }

        def broadcast():
            return packed_nccl_broadcast_producer(
                iterator=iter(weights), group=self.group, src=0, post_iter_func=lambda item: item[1]
            )

        try:
            self._alongside(broadcast, "POST", "/update_weights", {"update_info": info}, timeout)
        finally:
            request("POST", "/finish_weight_update", None, timeout, "weight sync")
            request("POST", "/resume", None, timeout, "weight sync")

    def _alongside(self, collective, method, path, body, timeout):
        """Run `collective` (NCCL, which has no timeout) on a thread while the HTTP request that drives the server's
        side runs here: a failure surfaces as the HTTP error, not as a hang."""
        result, error = [], []
        thread = threading.Thread(target=lambda: _capture(collective, result, error), daemon=True)
        thread.start()
        self.engine._request(method, path, body, timeout, "weight sync")
        thread.join(timeout)
        if error:
            raise error[0]
        return result[0] if result else None

    def close(self) -> None:
        self.group = None


def _capture(function, result: list, error: list) -> None:
    try:
        result.append(function())
    except BaseException as e:  # noqa: BLE001 (re-raised by the caller's thread)
        error.append(e)
