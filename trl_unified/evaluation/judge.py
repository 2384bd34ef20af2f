"""`GRMReward`: a generative reward model (a judge) used as a reward function by any online trainer."""

import re
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer, GenerationConfig

from ..data.datasets import is_conversational_prompt
from ..data.vision import prepare_visual_messages
from ..generation import generate_batched, get_eos_token_ids
from ..models.loading import from_pretrained_checked, get_tokenizer, load_model_plain
from .answers import extract_answer


SCORE_TEMPLATE = (
    "Rate the response to the question from {low} to {high}. question : {prompt} response : {completion} "
    "Answer with <answer> score </answer> ."
)
PAIRWISE_TEMPLATE = (
    "Which response answers the question better? question : {prompt} Response A : {completion} "
    "Response B : {reference} Answer with <answer> A </answer> or <answer> B </answer> ."
)


def _as_text(value) -> str:
    return " ".join(str(m["content"]) for m in value) if is_conversational_prompt(value) else str(value)


class GRMReward:
    """Turn a generative reward model into a reward function with TRL's convention.

    For each (prompt, completion[, reference]) the judge prompt is formatted from `template`, sent to the judge as a
    user message when its tokenizer has a chat template (else as plain text), the judgment is generated greedily with
    `generate_batched` in batches of `batch_size`, its answer is extracted with `answer_extractor`, and mapped to a
    number:

    - `mode="score"`: the answer must be a number in `[low, high]`; reward = (score - low) / (high - low) in [0, 1].
    - `mode="pairwise"`: the judge compares the completion (Response A) with the row's reference (Response B, from
      the dataset column `reference_field`); "A" (completion better) -> 1.0, "B" -> 0.0, "tie" -> 0.5.

    An answer that cannot be parsed or mapped gives `None` (the trainer then ignores that row for this function).
    Rows with images or videos (dataset columns `images` / `image` / `videos` / `video`, which trainers pass to
    reward functions) show them to the judge before the question (a vision-language judge and its processor).

    Args:
        judge (`str` or `PreTrainedModel`): the GRM, as a model id/path or a model.
        processing_class (`PreTrainedTokenizerBase`, *optional*): the judge's tokenizer; loaded from its path if None.
        mode (`str`, *optional*, defaults to `"score"`): `"score"` or `"pairwise"`.
        template (`str`, *optional*): a format string with `{prompt}`, `{completion}` (and `{reference}`, `{low}`,
            `{high}`); defaults to `SCORE_TEMPLATE` / `PAIRWISE_TEMPLATE`.
        low (`float`, *optional*, defaults to 1): the lowest score of `mode="score"`.
        high (`float`, *optional*, defaults to 10): the highest score of `mode="score"`.
        reference_field (`str`, *optional*, defaults to `"reference"`): the dataset column with the reference answer.
        batch_size (`int`, *optional*, defaults to 8): judge prompts per `generate` call.
        max_new_tokens (`int`, *optional*, defaults to 64): tokens per judgment.
        answer_extractor (`str`, *optional*, defaults to `"tags"`): see `extract_answer`.

    Example:
    ```python
    >>> judge = GRMReward("path/to/grm", mode="score", low=1, high=10)
    >>> trainer = RLOOTrainer(policy, reward_funcs=[judge], args=args, train_dataset=dataset)
    ```
    """

    def __init__(
        self,
        judge,
        processing_class=None,
        mode: str = "score",
        template: str | None = None,
        low: float = 1.0,
        high: float = 10.0,
        reference_field: str = "reference",
        batch_size: int = 8,
        max_new_tokens: int = 64,
        answer_extractor: str = "tags",
    ):
        if mode not in ("score", "pairwise"):
            raise ValueError(f"mode={mode!r} is not one of ['pairwise', 'score'].")
        if mode == "score" and not low < high:
            raise ValueError(f"low={low} must be smaller than high={high}.")
        if isinstance(judge, str):
            judge = load_model_plain(judge, what="judge model")
        self.judge = judge.eval().requires_grad_(False)
        self.processing_class = processing_class or from_pretrained_checked(
            AutoTokenizer, judge.config._name_or_path, "judge tokenizer"
        )
        tokenizer = get_tokenizer(self.processing_class)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.mode, self.low, self.high = mode, low, high
        self.template = template or (SCORE_TEMPLATE if mode == "score" else PAIRWISE_TEMPLATE)
        self.reference_field, self.batch_size, self.answer_extractor = reference_field, batch_size, answer_extractor
        self.generation_config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=get_eos_token_ids(self.judge, tokenizer),
            disable_compile=True,
        )
        self.__name__ = "grm_judge"  # the name trainers log its reward under
        self.last_judgments: list[str] = []

    def _judge_prompts(self, prompts, completions, references, images=None, videos=None):
        tokenizer = get_tokenizer(self.processing_class)
        images, videos = images or [None] * len(prompts), videos or [None] * len(prompts)
        out = []
        for prompt, completion, reference, row_images, row_videos in zip(
            prompts, completions, references, images, videos, strict=True
        ):
            text = self.template.format(
                prompt=_as_text(prompt),
                completion=_as_text(completion),
                reference=_as_text(reference) if reference is not None else "",
                low=int(self.low) if float(self.low).is_integer() else self.low,
                high=int(self.high) if float(self.high).is_integer() else self.high,
            )
            if row_images or row_videos:  # the judge sees the row's images / videos before the question
                out.append(prepare_visual_messages([{"role": "user", "content": text}], row_images, row_videos))
            else:
                out.append([{"role": "user", "content": text}] if tokenizer.chat_template else text)
        return out

    def to_reward(self, answer: str | None) -> float | None:
        """Map an extracted (normalised) answer to a reward, or None when it does not parse."""
        if self.mode == "pairwise":
            return {"a": 1.0, "response a": 1.0, "b": 0.0, "response b": 0.0, "tie": 0.5}.get(answer)
        if answer is None or re.fullmatch(r"[-+]?\d+(\.\d+)?", answer.strip()) is None:
            return None
        score = float(answer)
        return (score - self.low) / (self.high - self.low) if self.low <= score <= self.high else None

    @torch.no_grad()
    def __call__(self, prompts: Sequence, completions: Sequence, **kwargs) -> list[float | None]:
        references = kwargs.get(self.reference_field)
        if self.mode == "pairwise" and references is None:
            raise ValueError(f"GRMReward(mode='pairwise') needs the dataset column {self.reference_field!r}.")
        references = references if references is not None else [None] * len(prompts)
        images, videos = kwargs.get("images"), kwargs.get("videos")  # dataset columns of vision-language rows
        if images is None and kwargs.get("image") is not None:
            images = [[image] for image in kwargs["image"]]
        if videos is None and kwargs.get("video") is not None:
            videos = [[video] for video in kwargs["video"]]
        judge_prompts = self._judge_prompts(prompts, completions, references, images, videos)
        out = generate_batched(
            self.judge,
            self.processing_class,
            judge_prompts,
            self.generation_config,
            batch_size=self.batch_size,
            images=images if images is not None and any(images) else None,
            videos=videos if videos is not None and any(videos) else None,
        )
        self.last_judgments = out.texts
        return [self.to_reward(extract_answer(text, self.answer_extractor)) for text in out.texts]
