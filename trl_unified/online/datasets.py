"""The online trainers' data: dataset checks before training, the repeat samplers (`sampler.py`: the layout) and their
data loaders; environments may own the data (`reset()` gives prompts)."""

from datasets import Dataset, IterableDataset

from ..data.datasets import dataset_columns, require_columns
from ..generation import max_positions, prompt_lengths
from .agents import EMPTY_PROMPT
from .sampler import RepeatedIterable, RepeatSampler


class OnlineDataMixin:
    """Dataset preparation, samplers and data loaders of `OnlineTrainer` (a mixin: it reads the trainer's `args`,
    `processing_class`, `accelerator` and `_environment_factory`)."""

    def prepare_dataset(self, dataset, name):
        dataset = super().prepare_dataset(dataset, name)
        if dataset is None:
            return self._environment_owned_dataset() if name == "train" else None
        if self._environment_factory is None or "prompt" in dataset_columns(dataset):
            require_columns(dataset, [list(self.prompt_columns)], f"{name} dataset", type(self).__name__)
        if isinstance(dataset, Dataset) and "prompt" in dataset.column_names:
            for i, prompt in enumerate(dataset["prompt"]):  # empty or missing prompts cannot be generated from
                if prompt in (None, []) or (isinstance(prompt, str) and not prompt.strip()):
                    raise ValueError(
                        f"{name} dataset row {i} has prompt {prompt!r}: every row needs a non-empty prompt (a string "
                        "or a list of messages). Filter such rows out, e.g. dataset.filter(lambda row: row['prompt'])."
                    )
            need = self.args.generation_batch_size // self.args.num_generations
            if name == "train" and len(dataset) < need and not self.keeps_incomplete_rounds:
                raise ValueError(
                    f"train_dataset has {len(dataset)} prompts, but one generation batch needs {need} distinct "
                    f"prompts (generation_batch_size={self.args.generation_batch_size} / "
                    f"num_generations={self.args.num_generations}); training would run 0 steps. Add prompts, or "
                    "lower per_device_train_batch_size / steps_per_generation."
                )
        return dataset

    def train(self, *args, **kwargs):
        factories, dataset = self._environment_factory, self.train_dataset
        if isinstance(factories, dict) and isinstance(dataset, Dataset):  # before the first rollout (TRL: in it)
            if "environment" not in dataset.column_names:
                raise ValueError(
                    f"environment_factory is a dict ({list(factories)}), so each row of the train dataset must name "
                    "its environment in an `environment` column; the dataset has none."
                )
            unknown = sorted({str(v) for v in dataset.unique("environment")} - {str(k) for k in factories})
            if unknown:
                raise ValueError(
                    f"The train dataset has `environment={unknown[0]!r}`, which is not among the environments passed "
                    f"to `environment_factory`. Expected one of: {list(factories)}. Fix the column or add the factory."
                )
        return super().train(*args, **kwargs)

    def _environment_owned_dataset(self) -> Dataset:
        """Without a train_dataset, the environment owns the data: `reset()` supplies each prompt (TRL's rule)."""
        factory = self._environment_factory
        if factory is None:
            raise ValueError(
                f"`train_dataset` is required unless an `environment_factory` is provided: {type(self).__name__} "
                "needs prompts to generate from."
            )
        if isinstance(factory, dict):
            raise ValueError(
                "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                "`environment` column to route each example to its environment. Provide a dataset, or pass a single "
                "environment factory."
            )
        if self.args.max_steps <= 0:
            raise ValueError(
                "When training without a `train_dataset` (the environment owns the data and returns the prompt from "
                "`reset()`), `max_steps` must be set to a positive value to define the training length. Set it via "
                f"`{type(self.args).__name__}(max_steps=...)`."
            )
        rows = self.args.generation_batch_size // self.args.num_generations
        return Dataset.from_dict({"prompt": [EMPTY_PROMPT] * rows})

    def _check_prompt_lengths(self) -> None:
        """The longest prompt plus `max_completion_length` must fit the model's positions (`max_position_embeddings`),
        checked on the tokenised prompts of map-style datasets before training; `generate_batched` checks the rest."""
        limit = max_positions(self.accelerator.unwrap_model(self.model))
        if limit is None:
            return
        new_tokens = self.args.max_completion_length or 0  # None: generate's own default length
        datasets = {"train": self.train_dataset}
        datasets.update(self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset})
        for name, dataset in datasets.items():
            names = dataset.column_names if isinstance(dataset, Dataset) else []
            if "prompt" not in names or any(c in names for c in ("image", "images")):
                continue
            lengths = prompt_lengths(self.processing_class, dataset["prompt"], self.args.chat_template_kwargs)
            row = max(range(len(lengths)), key=lengths.__getitem__)
            if lengths[row] + new_tokens > limit:
                raise ValueError(
                    f"{name} dataset row {row} has a prompt of {lengths[row]} tokens; with max_completion_length="
                    f"{new_tokens} that is {lengths[row] + new_tokens} positions, beyond the model's maximum of "
                    f"{limit} (config.max_position_embeddings). Shorten or filter long prompts, or lower "
                    "max_completion_length."
                )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "image", "images"]

    def _repeats(self) -> tuple[int, int, int]:
        """The training samplers' layout: (completions per prompt, prompts per generation batch, reads of a batch)."""
        g, a = self.args.num_generations, self.args
        return g, a.generation_batch_size // g, a.num_iterations * a.steps_per_generation

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return RepeatSampler(
            dataset,
            *self._repeats(),
            shuffle=self.args.shuffle_dataset,
            seed=self.args.seed,
            drop_last=not self.keeps_incomplete_rounds,
        )

    def _get_eval_sampler(self, eval_dataset):
        return RepeatSampler(eval_dataset, mini_repeat_count=self.num_generations_eval, seed=self.args.seed)

    def get_train_dataloader(self):
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            shuffled = dataset.shuffle(seed=self.args.seed) if self.args.shuffle_dataset else dataset
            dataset = RepeatedIterable(shuffled, *self._repeats())
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self.args.generation_batch_size // self.accelerator.num_processes,  # a whole round
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = dataset if dataset is not None else self.eval_dataset
        if not isinstance(dataset, IterableDataset):
            return super().get_eval_dataloader(eval_dataset)
        # Each eval prompt repeated num_generations_eval times, as the map-style RepeatSampler does; one worker only
        # for this loader, so the stream is not interleaved (the train loader keeps its own setting).
        repeated = RepeatedIterable(dataset.shuffle(seed=self.args.seed), self.num_generations_eval, 1, 1)
        workers, self.args.dataloader_num_workers = self.args.dataloader_num_workers, 0
        try:
            return self._get_dataloader(
                dataset=repeated,
                description="Evaluation",
                batch_size=self.args.eval_batch_size,
                sampler_fn=self._get_eval_sampler,
                dataloader_key=eval_dataset if isinstance(eval_dataset, str) else None,
            )
        finally:
            self.args.dataloader_num_workers = workers
