"""Not a test: `python preference_peak_rss.py DPO|ORPO OUTPUT_DIR` trains a 12M-parameter policy for 2 steps on the
toy preference rows and prints the process's peak RSS in KiB (read by tests/trainers/test_reference_free.py)."""

import os
import sys


os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import trl_unified  # noqa: E402
from trl_unified.scripts.preference import toy_preferences  # noqa: E402
from trl_unified.testing import build_causal_lm, build_tokenizer, peak_rss_kib  # noqa: E402


def main(name: str, output_dir: str) -> None:
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=512, num_layers=4)  # ~12M parameters
    args = getattr(trl_unified, f"{name}Config")(
        output_dir=output_dir, per_device_train_batch_size=4, max_steps=2, bf16=False, report_to=[],
        save_strategy="no", gradient_checkpointing=False, logging_steps=1,
    )  # fmt: skip
    trainer = getattr(trl_unified, f"{name}Trainer")(
        model, args=args, train_dataset=toy_preferences(16, 0), processing_class=tokenizer
    )
    trainer.train()
    print(peak_rss_kib())


if __name__ == "__main__":
    main(*sys.argv[1:3])
