"""The vLLM server engine against a stand-in server on loopback (tests/jobs/vllm_server_stand_in.py): a server that
refuses, stalls or restarts mid-run is retried until it is back (the last synced weights loaded into it first), one
that stays away stops the run with an error naming the URL, the phase, the step and the last checkpoint; vLLM's NCCL
weight transfer follows TRL 1.16's request sequence. The real server (killed and restarted mid-run) is tests/vllm."""

import sys
import threading
import time
import types

import pytest
import torch
from accelerate import Accelerator
from transformers import GenerationConfig, TrainerCallback

from tests.helpers import grpo_args, prompt_dataset, varied_reward
from tests.jobs.vllm_server_stand_in import VLLMServerStandIn
from trl_unified import GRPOTrainer
from trl_unified.generation.vllm_server import VLLMServerEngine
from trl_unified.testing import build_causal_lm


GREEDY = GenerationConfig(max_new_tokens=3, do_sample=False)


@pytest.fixture
def server():
    stand_in = VLLMServerStandIn()
    yield stand_in
    stand_in.down()


def engine_for(server, tmp_path, **overrides):
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=20)
    return VLLMServerEngine(grpo_args(tmp_path, **{**settings, **overrides}), Accelerator(cpu=True))


def test_a_server_that_restarts_loses_no_request_and_gets_the_weights_back_first(server, tmp_path):
    engine = engine_for(server, tmp_path)
    engine.synced = (0, 3)  # the weights of step 3 were synced (their folder written)
    server.down()
    threading.Timer(1.5, server.up).start()
    completions, logprobs = engine.generate([[1, 2], [1, 2]], GREEDY, [2])
    assert [c.tolist() for c in completions] == [[7, 8, 9]] * 2
    assert torch.allclose(logprobs[0], torch.full((3,), -0.5))
    after = server.requests[server.requests.index("GET /v1/models") + 1 :]
    reload = after.index("POST /collective_rpc")  # the last weights, from the folder written at their sync
    assert after[reload:] == ["POST /collective_rpc", "POST /reset_prefix_cache", "POST /v1/completions"], after
    assert server.bodies[-3]["kwargs"]["weights_path"] == engine.weights_dir


def test_a_server_that_stays_away_stops_the_run_with_an_error_that_names_what_matters(server, tmp_path):
    engine = engine_for(server, tmp_path, vllm_server_timeout=2)
    engine.context = lambda: ", at global step 5; last saved checkpoint: out/checkpoint-4"
    server.down()
    start = time.monotonic()
    with pytest.raises(ConnectionError) as error:
        engine.generate([[1, 2]], GREEDY, [2])
    message = str(error.value)
    for part in (server.url, "generation", "global step 5", "out/checkpoint-4", "resume_from_checkpoint"):
        assert part in message, message
    assert time.monotonic() - start < 15
    server.up()


def test_a_stalled_request_is_retried_once_it_times_out(server, tmp_path):
    engine = engine_for(server, tmp_path, request_timeout=1)
    server.stall_for = 3.0
    completions, _ = engine.generate([[1, 2]], GREEDY, [2])
    assert [c.tolist() for c in completions] == [[7, 8, 9]]
    assert server.requests.count("POST /v1/completions") == 2


def test_a_request_carries_at_most_max_inflight_tasks_completions(server, tmp_path):
    engine = engine_for(server, tmp_path, max_inflight_tasks=4)
    engine.generate([[1]] * 2 + [[3]] * 2 + [[4]] * 2 + [[5, 6]] * 2, GREEDY, [2])  # 4 groups of 2
    requests = [body for request, body in zip(server.requests, server.bodies) if request == "POST /v1/completions"]
    assert [(len(body["prompt"]), body["n"]) for body in requests] == [(2, 2), (2, 2)]


def test_nccl_weight_transfer_follows_trls_request_sequence(server, tmp_path, monkeypatch):
    """vLLM's trainer-side NCCL calls played by fakes (NCCL needs CUDA); the HTTP side is the real engine's."""
    sent, groups = [], []

    def trainer_init(info):
        groups.append(info)
        return "group"

    def broadcast(iterator, group, src, post_iter_func):
        sent.extend((name, post_iter_func((name, tensor)).clone()) for name, tensor in iterator)

    modules = {
        "vllm.distributed.weight_transfer.nccl_common": types.SimpleNamespace(trainer_init=trainer_init),
        "vllm.distributed.weight_transfer.packed_tensor": types.SimpleNamespace(
            packed_nccl_broadcast_producer=broadcast
        ),
        "vllm.utils.network_utils": types.SimpleNamespace(get_ip=lambda: "10.0.0.1", get_open_port=lambda: 29500),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    engine = engine_for(server, tmp_path)
    monkeypatch.setattr(engine.args, "vllm_weight_transfer", "nccl")
    model = build_causal_lm_with_tokenizer()
    engine.ensure_synced(model, Accelerator(cpu=True), owner=object(), version=1)
    engine.ensure_synced(model, Accelerator(cpu=True), owner=object(), version=2)
    control = [r for r in server.requests if r not in ("GET /health", "GET /v1/models") and "server_info" not in r]
    per_sync = ["POST /pause?mode=keep", "POST /start_weight_update", "POST /update_weights",
                "POST /finish_weight_update", "POST /resume"]  # fmt: skip
    assert control == ["GET /get_world_size", "POST /init_weight_transfer_engine", *per_sync, *per_sync], control
    init = server.bodies[server.requests.index("POST /init_weight_transfer_engine")]["init_info"]
    assert init == groups[0] == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                                 "world_size": 2, "packed": True}  # fmt: skip
    update = server.bodies[server.requests.index("POST /update_weights")]["update_info"]
    names = [name for name, _ in model.named_parameters()]
    assert update["names"] == names == [name for name, _ in sent[: len(names)]]
    assert update["dtype_names"] == ["float32"] * len(names)
    assert update["shapes"] == [list(p.shape) for p in model.parameters()]
    assert server.bodies[server.requests.index("POST /start_weight_update")] == {"is_checkpoint_format": True}


def build_causal_lm_with_tokenizer():
    from trl_unified.testing import build_tokenizer

    return build_causal_lm(build_tokenizer())


class RestartServerAt(TrainerCallback):
    def __init__(self, server, step):
        self.server, self.step = server, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.down()
            threading.Timer(1.0, self.server.up).start()


def test_training_rides_through_a_server_restart(server, tokenizer, tmp_path):
    args = grpo_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, max_steps=4,
                     vllm_server_timeout=20, per_device_train_batch_size=4)  # fmt: skip
    trainer = GRPOTrainer(build_causal_lm(tokenizer), varied_reward, args=args, train_dataset=prompt_dataset(),
                          processing_class=tokenizer)  # fmt: skip
    trainer.add_callback(RestartServerAt(server, 2))
    trainer.train()
    assert trainer.state.global_step == 4
    assert server.requests.count("POST /v1/completions") == 4  # one round per step, none lost


def test_a_background_sync_loads_a_snapshot_while_training_goes_on(server, tmp_path):
    """One process: the weights are copied when the sync starts; training may change them meanwhile; the server
    gets the copy, and the engine reports the version once the reload is done."""
    engine, model = engine_for(server, tmp_path), build_causal_lm_with_tokenizer()
    accelerator, owner = Accelerator(cpu=True), object()
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.sync_in_background(model, accelerator, owner, 4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # training goes on
    engine.wait_for_sync()
    assert engine.version == 4 and server.requests[-2:] == ["POST /collective_rpc", "POST /reset_prefix_cache"]
    from safetensors.torch import load_file

    written = load_file(f"{engine.weights_dir}/model.safetensors")
    assert all(torch.equal(written[name], value) for name, value in snapshot.items())


def test_a_failed_background_sync_is_raised(server, tmp_path):
    engine = engine_for(server, tmp_path, vllm_server_timeout=1)
    server.down()
    engine.sync_in_background(build_causal_lm_with_tokenizer(), Accelerator(cpu=True), object(), 1)
    with pytest.raises(ConnectionError, match="weight sync"):
        engine.wait_for_sync()
    assert engine.version is None
    server.up()
