"""push_to_hub against a stand-in Hub on loopback: weights (or adapter), tokenizer, model card; no token leaks."""

import os
import subprocess
import sys

import pytest

from tests.jobs.hub_server import HubStandIn


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "hf_thisIsASecretTestToken123"


@pytest.mark.parametrize(
    "kind",  # the PEFT case by default (adapter, card, tokenizer); full models with -m slow
    [pytest.param("rloo", marks=pytest.mark.slow), "rloo_peft", pytest.param("grm", marks=pytest.mark.slow),
     pytest.param("dpo", marks=pytest.mark.slow)],
)  # fmt: skip
def test_push_to_hub_uploads_model_tokenizer_and_card(kind, tmp_path):
    with HubStandIn() as hub:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": "1",
            "WANDB_DISABLED": "true",
        }
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tests", "jobs", "push_to_hub_job.py"), kind, str(tmp_path), TOKEN],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=ROOT,
        )
        assert result.returncode == 0 and "pushed" in result.stdout, result.stderr[-4000:] + "\n".join(hub.requests)
        files = hub.files[f"tester/tiny-{kind}"]
    if kind == "rloo_peft":
        assert (
            "adapter_model.safetensors" in files
            and "adapter_config.json" in files
            and "model.safetensors" not in files
        )
    else:
        assert "model.safetensors" in files and "config.json" in files
    assert not any(name.endswith((".bin", ".pt")) and "training_args" not in name for name in files)
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    card = files["README.md"].decode()
    trainer = {"grm": "GRM", "rloo": "RLOO", "rloo_peft": "RLOO", "dpo": "DPO"}[kind]
    assert f"**{trainer}**" in card and f"{trainer}Trainer" in card
    assert "tester/toy-prompts" in card  # dataset
    paper = {"RLOO": "2402.14740", "GRM": "2408.15240", "DPO": "2305.18290"}[trainer]
    assert paper in card and "@" in card  # the paper's citation
    assert "trl_unified" in card and "tags:" in card
    for name, content in files.items():
        assert TOKEN.encode() not in content, f"token leaked into {name}"
    assert TOKEN not in result.stdout and TOKEN not in result.stderr
