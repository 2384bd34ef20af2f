"""Shared fixtures: tiny models and a word-level tokenizer, built locally and saved so they load by path."""

import os


os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: 1 thread is fastest and stable (MACHINE_NOTES)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

from trl_unified.testing import (  # noqa: E402
    build_causal_lm,
    build_encoder_decoder,
    build_sequence_classifier,
    build_tokenizer,
    save_tiny_model,
)


torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def llama_path(tiny_dir, tokenizer):
    """A tiny Llama causal LM saved to disk: pass the path where a Hub id would go."""
    return save_tiny_model(build_causal_lm(tokenizer, "llama"), tokenizer, str(tiny_dir / "llama"))


@pytest.fixture(scope="session")
def qwen2_path(tiny_dir, tokenizer):
    """A tiny Qwen2 causal LM saved to disk (load its tokenizer with PreTrainedTokenizerFast: see MACHINE_NOTES)."""
    return save_tiny_model(build_causal_lm(tokenizer, "qwen2"), tokenizer, str(tiny_dir / "qwen2"))


@pytest.fixture(scope="session")
def reward_model_path(tiny_dir, tokenizer):
    return save_tiny_model(build_sequence_classifier(tokenizer), tokenizer, str(tiny_dir / "reward"))


@pytest.fixture(scope="session")
def t5_path(tiny_dir, tokenizer):
    return save_tiny_model(build_encoder_decoder(tokenizer), tokenizer, str(tiny_dir / "t5"))


@pytest.fixture
def qwen2_model(tokenizer):
    return build_causal_lm(tokenizer, "qwen2")


@pytest.fixture
def llama_model(tokenizer):
    return build_causal_lm(tokenizer, "llama")


class Engines(list):
    """The engines the trainers of a test build; `options`: SnapshotEngine's keywords for the next ones."""

    options: dict = {}


@pytest.fixture
def engines(monkeypatch, tokenizer):
    """Every vLLM engine a trainer builds in this test is a `tests.helpers.SnapshotEngine` (a stand-in server)."""
    from tests.helpers import SnapshotEngine
    from trl_unified.generation.vllm_engine import VLLMEngine

    made = Engines()

    def build(args, model, accelerator):
        made.append(SnapshotEngine(args, tokenizer, **made.options))
        return made[-1]

    monkeypatch.setattr(VLLMEngine, "from_args", staticmethod(build))
    return made


def pytest_sessionfinish(session, exitstatus):
    # pytest ends with `raise SystemExit(status)`; once a test armed core/shutdown.py's exit handler (an in-process
    # process group: the vllm group), that handler ends the process with the status it was told: tell it this one.
    from trl_unified.core import shutdown

    shutdown.record_exit_status(int(exitstatus))


def pytest_collection_modifyitems(config, items):
    """Tests that launch several processes (the `distributed` marker, and the command-line tests that launch with
    accelerate) share one xdist worker, so that at most one multi-process launch runs at a time on the 2 cores."""
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
