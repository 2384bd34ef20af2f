"""Dataset formats, padding and the grouped sampler shared by the online trainers."""

from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from torch.utils.data import Sampler

IMAGE_COLUMNS = ("image", "images")


def is_conversational_prompt(prompt: Any) -> bool:
    """True for a list of `{"role", "content"}` messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def pad(
    tensors: Sequence[torch.Tensor], padding_value: int, side: str = "right", pad_to_multiple_of: int | None = None
) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into `(N, L)`, padding on `side` ("left" or "right")."""
    if not tensors:
        return torch.empty(0, 0, dtype=torch.long)
    length = max(t.size(0) for t in tensors)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(tensors), length), padding_value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, t in enumerate(tensors):
        if side == "left":
            out[i, length - t.size(0) :] = t
        else:
            out[i, : t.size(0)] = t
    return out


def get_images(row: dict[str, Any]) -> list | None:
    """The images of a row (`images` list or single `image`), or None."""
    if row.get("images") is not None:
        return list(row["images"]) or None
    if row.get("image") is not None:
        return [row["image"]]
    return None


def column_names(dataset) -> list[str] | None:
    """Column names of a `Dataset`/`IterableDataset` (None when an iterable dataset does not know them)."""
    if isinstance(dataset, (Dataset, IterableDataset)):
        return list(dataset.column_names) if dataset.column_names is not None else None
    return None


def require_columns(dataset, required: Sequence[Sequence[str]], dataset_name: str, trainer_name: str) -> None:
    """Raise unless, for each group of alternatives in `required`, one column is present; and the set is non-empty."""
    if isinstance(dataset, Dataset) and len(dataset) == 0:
        raise ValueError(f"{dataset_name} is empty: {trainer_name} needs at least one row.")
    names = column_names(dataset)
    if names is None:
        return
    for alternatives in required:
        if not any(col in names for col in alternatives):
            wanted = " or ".join(repr(c) for c in alternatives)
            raise ValueError(
                f"{dataset_name} has columns {names} but {trainer_name} needs a {wanted} column. "
                f"Rename your column (dataset.rename_column(old, {alternatives[0]!r})) or map your rows to that format."
            )


class RepeatSampler(Sampler):
    """Yield each index `mini_repeat_count` times in a row, in chunks of `batch_size` distinct indices, each chunk
    repeated `repeat_count` times. Incomplete final chunks are dropped.

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
    ):
        self.num_samples = len(data_source)
        self.mini_repeat_count, self.batch_size, self.repeat_count = mini_repeat_count, batch_size, repeat_count
        self.shuffle = shuffle
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.num_samples, generator=self.generator).tolist() if self.shuffle else range(self.num_samples)
        order = list(order)
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for chunk in (c for c in chunks if len(c) == self.batch_size):
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return (self.num_samples // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count


def shuffle_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """Permute every per-row value of `batch` (tensors with a batch dim, lists) with one `torch.randperm`."""
    size = next(len(v) for v in batch.values() if isinstance(v, (list, torch.Tensor)) and getattr(v, "ndim", 1) > 0)
    permutation = torch.randperm(size)

    def permute(value):
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == size:
            return value[permutation]
        if isinstance(value, list) and len(value) == size:
            return [value[i] for i in permutation]
        return value

    return {key: permute(value) for key, value in batch.items()}


def split_batch(batch: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Split every per-row value of `batch` into `num_chunks` equal, contiguous micro-batches."""
    size = next(len(v) for v in batch.values() if isinstance(v, (list, torch.Tensor)) and getattr(v, "ndim", 1) > 0)
    if size % num_chunks:
        raise ValueError(f"Cannot split a batch of {size} rows into {num_chunks} equal micro-batches.")
    step = size // num_chunks

    def take(value, i):
        if isinstance(value, (list, torch.Tensor)) and getattr(value, "ndim", 1) > 0 and len(value) == size:
            return value[i * step : (i + 1) * step]
        return value

    return [{key: take(value, i) for key, value in batch.items()} for i in range(num_chunks)]
