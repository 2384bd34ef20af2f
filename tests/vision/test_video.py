"""Video rows (the `vision` group: transformers' video processors need torchvision, installed beside a matching
torch in its own environment by `.ci/run`; run with `pytest -m vision tests/vision`)."""

import json

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from tests.helpers import UNSET, tiny_run_args
from trl_unified import GRMConfig, GRMReward, GRMTrainer
from trl_unified.testing import build_image, build_video, build_vision_language_model


pytestmark = pytest.mark.vision
WORDS = ["brighter", "or", "darker", "?", "<answer>", "</answer>"]


def video_row(i, with_image=False):
    trend = "brighter" if i % 2 else "darker"
    return {
        "prompt": [{"role": "user", "content": "brighter or darker ?"}],
        "completion": [{"role": "assistant", "content": f"<answer> {trend} </answer>"}],
        "images": [build_image(i)] if with_image else [],
        "videos": [build_video(trend, seed=i)],
    }


def grm_args(tmp_path, **kwargs):
    defaults = dict(optim="sgd", max_steps=1, gradient_checkpointing=UNSET, eval_max_new_tokens=6)
    return tiny_run_args(GRMConfig, tmp_path, **{**defaults, **kwargs})


def test_video_rows_learn_the_judgment_only_with_the_hand_computed_loss(tmp_path):
    model, processor = build_vision_language_model(WORDS, video=True)
    rows = [video_row(i, with_image=i == 0) for i in range(4)]  # one batch: a row with an image and a video
    trainer = GRMTrainer(
        model, args=grm_args(tmp_path), train_dataset=Dataset.from_list(rows), processing_class=processor
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert {"pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw"} <= set(batch.visual_inputs)
    video_token = model.config.video_token_id
    for i in range(4):
        labels = batch.labels[i]
        trend = "brighter" if i % 2 else "darker"
        assert processor.decode(labels[labels != -100]) == f"<answer> {trend} </answer> <|im_end|>"
        assert (batch.input_ids[i] == video_token).sum() > 1  # the placeholder expanded into the video's tokens
    trainer.model.eval()
    with torch.no_grad():
        loss, _ = trainer.compute_policy_loss(trainer.model, batch)
        logits = trainer.model(**batch.model_inputs()).logits[:, :-1].float()
    targets = batch.labels[:, 1:]
    mask = targets != -100
    log_probs = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    torch.testing.assert_close(loss, -(log_probs * mask).sum() / mask.sum())
    torch.testing.assert_close(
        loss, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
    )


def test_gradient_accumulation_equals_a_bigger_batch_on_video_rows(tmp_path):
    rows = Dataset.from_list([video_row(i) for i in range(8)])
    params = []
    for batch_size, accumulation in ((4, 2), (8, 1)):
        model, processor = build_vision_language_model(WORDS, video=True)
        args = grm_args(tmp_path / f"{batch_size}", per_device_train_batch_size=batch_size,
                        gradient_accumulation_steps=accumulation)  # fmt: skip
        trainer = GRMTrainer(model, args=args, train_dataset=rows, processing_class=processor)
        trainer.train()
        params.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    changed = False
    for name, value in params[0].items():
        torch.testing.assert_close(value, params[1][name], rtol=1e-5, atol=1e-6, msg=name)
    model, _ = build_vision_language_model(WORDS, video=True)
    changed = any(not torch.equal(p, params[0][n]) for n, p in model.named_parameters() if "visual" in n)
    assert changed  # the vision tower trained on the videos


def test_video_judge_learns_brighter_or_darker(tmp_path):
    """Only the order of the frames tells the answer (the same brightness levels either way): held-out accuracy
    rises from below chance (0.5: always the same answer) to at least 0.9."""
    model, processor = build_vision_language_model(WORDS, video=True)
    train = Dataset.from_list([video_row(i) for i in range(64)])
    held_out = Dataset.from_list([video_row(1000 + i) for i in range(16)])
    args = grm_args(
        tmp_path,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        optim="adamw_torch",
        max_steps=40,
        lr_scheduler_type="constant",
        per_device_eval_batch_size=16,
        logging_steps=10,
    )
    trainer = GRMTrainer(model, args=args, train_dataset=train, eval_dataset=held_out, processing_class=processor)
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()
    print(f"held-out accuracy {before:.2f} -> {after['eval_accuracy']:.2f}")
    assert before < 0.5 and after["eval_accuracy"] >= 0.9
    with open(trainer.last_eval_records_path) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == len(held_out)
    assert all({"type": "video"} in r["prompt"][0]["content"] for r in records)
    assert [r["reference"] for r in records] == ["brighter" if i % 2 else "darker" for i in range(1000, 1016)]
    assert after["eval_accuracy"] == pytest.approx(sum(r["correct"] for r in records) / len(records))


def test_grm_reward_shows_the_judge_the_rows_videos():
    judge, processor = build_vision_language_model(WORDS, video=True)
    reward = GRMReward(judge, processing_class=processor, max_new_tokens=4)
    videos = [[build_video("brighter", seed=1)], [build_video("darker", seed=2)]]
    scores = reward(["brighter or darker ?"] * 2, ["brighter", "darker"], videos=videos)
    assert len(scores) == 2 and len(reward.last_judgments) == 2
    prompts = reward._judge_prompts(["q"] * 2, ["a"] * 2, [None] * 2, None, videos)
    assert all(p[0]["content"][0] == {"type": "video"} for p in prompts)


def test_unreadable_videos_raise_before_training(tmp_path):
    model, processor = build_vision_language_model(WORDS, video=True)
    bad_path = {**video_row(0), "videos": [str(tmp_path / "missing.mp4")]}
    with pytest.raises(ValueError, match=r"Row 0: video path .*missing.mp4.* does not exist"):
        GRMTrainer(
            model, args=grm_args(tmp_path), train_dataset=Dataset.from_list([bad_path]), processing_class=processor
        )
    frames = [build_image(0, size=56), build_image(1, size=28)]
    ragged = {**video_row(0), "videos": [frames]}
    with pytest.raises(ValueError, match=r"Row 0: the frames of a video have different sizes"):
        GRMTrainer(
            model, args=grm_args(tmp_path), train_dataset=Dataset.from_list([ragged]), processing_class=processor
        )


def test_a_video_as_a_list_of_frames_equals_the_array(tmp_path):
    from PIL import Image

    model, processor = build_vision_language_model(WORDS, video=True)
    array_row = video_row(1)
    frames_row = {**array_row, "videos": [[Image.fromarray(frame) for frame in array_row["videos"][0]]]}
    batches = []
    for row in (array_row, frames_row):
        trainer = GRMTrainer(
            model, args=grm_args(tmp_path), train_dataset=Dataset.from_list([row]), processing_class=processor
        )
        batches.append(trainer.data_collator([trainer.train_dataset[0]]))
    torch.testing.assert_close(batches[0].visual_inputs, batches[1].visual_inputs)
    assert torch.equal(batches[0].input_ids, batches[1].input_ids)
