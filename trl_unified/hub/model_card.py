"""Model cards: README.md with the trainer, base model, datasets, tags and the algorithm's citation."""

import importlib.metadata
import os

from huggingface_hub import ModelCard, ModelCardData

from ..models.loading import model_id_of


_TEMPLATE = """---
{card_data}
---

# Model card for {model_name}

This model is a fine-tuned version of [{base_model}]({base_model_link}){dataset_sentence}.
It was trained with **{trainer_name}** from [trl_unified](https://github.com/trl-unified/trl_unified), a
`transformers.Trainer`-based library in the style of TRL.

## Quick start

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{repo_id}")
print(generator("Hello,", max_new_tokens=32)[0]["generated_text"])
```

## Training procedure

Trainer: `{trainer_class}` ({algorithm}).{paper_sentence}

## Framework versions

{versions}

## Citations

{citation}
"""


def _dataset_names(trainer) -> list[str]:
    """Names of the training datasets that know theirs (loaded with `load_dataset`); in-memory ones have none."""
    info = getattr(trainer.train_dataset, "info", None)
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    return [name] if name and name not in ("generator", "json", "csv", "parquet", "arrow", "text") else []


def _as_tag_list(tags) -> list:
    """`tags` as given to `write_model_card`: a list, one tag, or None."""
    if isinstance(tags, list):
        return tags
    if tags:
        return [tags]
    return []


def _versions() -> str:
    names = {"trl_unified": "trl_unified", "TRL": "trl", "Transformers": "transformers", "PyTorch": "torch",
             "Datasets": "datasets", "Accelerate": "accelerate"}  # fmt: skip
    return "\n".join(f"- {label}: {importlib.metadata.version(name)}" for label, name in names.items())


def write_model_card(
    trainer, model_name: str | None = None, dataset_name: str | None = None, tags=None, output_dir: str | None = None
) -> str:
    """Write `README.md` into `output_dir` (default `trainer.args.output_dir`) and return its path. Nothing secret is
    written: no token, no local absolute path of the training machine beyond the base model's."""
    output_dir = output_dir or trainer.args.output_dir
    base_model = model_id_of(trainer.model)
    base_is_hub_id = not os.path.isdir(base_model) and "/" in base_model
    datasets_ = [dataset_name] if dataset_name else _dataset_names(trainer)
    all_tags = sorted({*trainer._tag_names, *_as_tag_list(tags)})
    paper = trainer._paper or {"title": "", "id": "", "citation": ""}
    model_name = model_name or os.path.basename(os.path.normpath(trainer.args.output_dir))
    card_data = ModelCardData(
        base_model=base_model if base_is_hub_id else None,
        datasets=datasets_ or None,
        library_name="transformers",
        model_name=model_name,
        tags=all_tags,
    )
    card = ModelCard(
        _TEMPLATE.format(
            card_data=card_data.to_yaml(),
            model_name=model_name,
            base_model=base_model,
            base_model_link=f"https://huggingface.co/{base_model}" if base_is_hub_id else base_model,
            dataset_sentence=f" on the dataset(s) {', '.join(datasets_)}" if datasets_ else "",
            trainer_name=trainer._name,
            trainer_class=type(trainer).__name__,
            algorithm=paper["title"] or trainer._name,
            paper_sentence=f" Paper: [{paper['title']}](https://huggingface.co/papers/{paper['id']})."
            if paper["id"]
            else "",
            repo_id=trainer.args.hub_model_id or model_name,
            versions=_versions(),
            citation=f"```bibtex\n{paper['citation']}\n```" if paper["citation"] else "",
        )
    )
    path = os.path.join(output_dir, "README.md")
    os.makedirs(output_dir, exist_ok=True)
    card.save(path)
    return path
