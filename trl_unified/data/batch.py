"""`TensorBatch`: the base of the typed batches that flow between the data, the rollout and the losses."""

import dataclasses

import torch


def _take(value, index: torch.Tensor):
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    if isinstance(value, TensorBatch):
        return value.select(index)
    if isinstance(value, list):
        return [value[i] for i in index.tolist()]
    if isinstance(value, dict):
        return {k: _take(v, index) for k, v in value.items()}
    return value


def _move(value, device):
    if isinstance(value, (torch.Tensor, TensorBatch)):
        return value.to(device)
    if isinstance(value, list):
        return [_move(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


@dataclasses.dataclass
class TensorBatch:
    """A dataclass of per-row tensors (and lists / dicts of them, and nested batches), with what every stage needs:
    `to(device)`, `select(rows)`, and read access by field name (`"labels" in batch`, `batch["labels"]`, `keys()`,
    `items()`, `get()`, as the dicts TRL's trainers pass around) so that
    `transformers.Trainer`'s own bookkeeping (e.g. counting loss tokens from `labels`) works on it.

    A field that is None is absent: `"x" in batch` is False. Subclasses document their fields and shapes.
    """

    def to(self, device) -> "TensorBatch":
        """A copy with every tensor on `device`."""
        fields = [f for f in dataclasses.fields(self) if f.init]
        return dataclasses.replace(self, **{f.name: _move(getattr(self, f.name), device) for f in fields})

    def select(self, index: torch.Tensor) -> "TensorBatch":
        """The rows `index` (a 1-D long tensor) of every per-row field, in that order."""
        fields = [f for f in dataclasses.fields(self) if f.init and f.metadata.get("per_row", True)]
        return dataclasses.replace(self, **{f.name: _take(getattr(self, f.name), index) for f in fields})

    def __contains__(self, name: str) -> bool:
        return name in {f.name for f in dataclasses.fields(self)} and getattr(self, name) is not None

    def __getitem__(self, name: str):
        if name not in self:
            raise KeyError(name)
        return getattr(self, name)

    def keys(self) -> list[str]:
        """The names `batch[name]` answers (fields that are not None), as a dict's keys."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def items(self):
        return [(name, self[name]) for name in self.keys()]

    def get(self, name: str, default=None):
        return self[name] if name in self else default


def scalar_field(default=None, default_factory=None):
    """A field that is not indexed by row (a count over the batch, or tensors laid out per image patch):
    `select` keeps it as it is."""
    kind = {"default_factory": default_factory} if default_factory is not None else {"default": default}
    return dataclasses.field(**kind, metadata={"per_row": False})
