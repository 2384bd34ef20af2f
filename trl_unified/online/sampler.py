"""The online trainers' samplers: each prompt `mini_repeat_count` times in a row (one group of completions), the
generation batch repeated for every micro-batch and pass that reads it; `RepeatedIterable` is the streaming twin."""

from collections.abc import Iterator, Sized

import torch
from datasets import IterableDataset
from torch.utils.data import Sampler


class RepeatSampler(Sampler):
    """Yield each index `mini_repeat_count` times in a row, in chunks of `batch_size` distinct indices, each chunk
    repeated `repeat_count` times. An incomplete final chunk is dropped, unless `drop_last=False` (rounds that need
    no whole groups: A*-PO's one completion per prompt).

    This is how an online trainer lays out a generation batch: the `G` completions of a prompt are contiguous
    (so a group is easy to find), and the same prompts come back for `num_iterations * steps_per_generation`
    micro-steps. The order equals `trl`'s sampler for the same seed.

    Example:
    ```python
    >>> list(RepeatSampler(["a", "b", "c", "d"], mini_repeat_count=2, batch_size=2, repeat_count=1, shuffle=False))
    [0, 0, 1, 1, 2, 2, 3, 3]
    ```
    """

    def __init__(
        self,
        data_source: Sized,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = True,
    ):
        self.num_samples, self.drop_last = len(data_source), drop_last
        self.mini_repeat_count, self.batch_size, self.repeat_count = mini_repeat_count, batch_size, repeat_count
        self.shuffle, self.generator = shuffle, torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        n = self.num_samples
        order = torch.randperm(n, generator=self.generator).tolist() if self.shuffle else list(range(n))
        last = len(order) if not self.drop_last else len(order) - self.batch_size + 1
        for start in range(0, last, self.batch_size):
            yield from _repeated(order[start : start + self.batch_size], self.mini_repeat_count, self.repeat_count)

    def __len__(self) -> int:
        kept = self.num_samples if not self.drop_last else (self.num_samples // self.batch_size) * self.batch_size
        return kept * self.mini_repeat_count * self.repeat_count


class RepeatedIterable(torch.utils.data.IterableDataset):
    """Streaming counterpart of `RepeatSampler`: chunks of `prompts_per_batch` rows, each row repeated
    `mini_repeat_count` times in a row, each chunk repeated `repeat_count` times."""

    def __init__(self, dataset: IterableDataset, mini_repeat_count: int, prompts_per_batch: int, repeat_count: int):
        self.dataset, self.mini_repeat_count = dataset, mini_repeat_count
        self.prompts_per_batch, self.repeat_count = prompts_per_batch, repeat_count

    def __iter__(self):
        chunk = []
        for row in self.dataset:
            chunk.append(row)
            if len(chunk) == self.prompts_per_batch:
                yield from _repeated(chunk, self.mini_repeat_count, self.repeat_count)
                chunk = []


def _repeated(chunk: list, mini_repeat_count: int, repeat_count: int):
    """The chunk `repeat_count` times, each item `mini_repeat_count` times in a row."""
    for _ in range(repeat_count):
        for item in chunk:
            yield from [item] * mini_repeat_count
