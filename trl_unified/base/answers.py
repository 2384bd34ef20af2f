"""Answer extraction and matching for generative evaluation accuracy, and an `evaluate` metric built on it."""

import re
from collections.abc import Callable


_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def _extract_tags(text: str) -> str | None:
    matches = _TAG_RE.findall(text)
    return matches[-1] if matches else None  # the last answer is the final one


def _extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the answer was cut off


def _extract_auto(text: str) -> str | None:
    found = _extract_tags(text)
    return found if found is not None else _extract_boxed(text)


ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "tags": _extract_tags,
    "boxed": _extract_boxed,
    "auto": _extract_auto,
}


def normalize_answer(answer: str | None) -> str | None:
    """Lower-case, collapse whitespace and strip surrounding whitespace and a trailing period; `None` stays `None`."""
    if answer is None:
        return None
    answer = " ".join(str(answer).split()).lower()
    answer = answer.rstrip(".").strip()
    return answer or None


def extract_answer(text: str, extractor: str | Callable[[str], str | None] = "tags") -> str | None:
    """Extract the answer from a generated text.

    Args:
        text (`str`):
            The generation.
        extractor (`str` or `Callable`, *optional*, defaults to `"tags"`):
            `"tags"` (`<answer>...</answer>`, the last one), `"boxed"` (`\\boxed{...}`, the last one), `"auto"`
            (tags, then boxed), `"regex:<pattern>"` (first capture group of the last match, or the whole match),
            or a callable returning the answer or `None`.

    Returns:
        `str | None`: the normalised answer (see `normalize_answer`), or `None` when none can be parsed.

    Example:
    ```python
    >>> extract_answer("I think <answer> Response A </answer>.")
    'response a'
    >>> extract_answer("so \\boxed{\\frac{1}{2}}", "boxed")
    '\\frac{1}{2}'
    ```
    """
    if callable(extractor):
        return normalize_answer(extractor(text))
    if extractor.startswith("regex:"):
        matches = list(re.finditer(extractor[len("regex:") :], text, re.DOTALL))
        if not matches:
            return None
        last = matches[-1]
        return normalize_answer(last.group(1) if last.groups() else last.group(0))
    return normalize_answer(ANSWER_EXTRACTORS[extractor](text))


def answers_match(predicted: str | None, reference: str | None) -> bool:
    """True when both answers parse and are equal after normalisation. An unparseable answer is never correct."""
    predicted, reference = normalize_answer(predicted), normalize_answer(reference)
    return predicted is not None and reference is not None and predicted == reference


def _build_answer_accuracy():
    # `evaluate` imports transformers.pipelines (seconds and tens of MB): only pay for it when the metric is used.
    import datasets
    import evaluate

    class AnswerAccuracy(evaluate.Metric):
        """`evaluate` metric: fraction of predictions whose normalised answer equals the reference's.

        An unparseable prediction (passed as `""`, since `evaluate` takes strings only) is counted wrong, and so is a
        row whose reference is empty.

        Example:
        ```python
        >>> AnswerAccuracy().compute(predictions=["a", "", "B "], references=["a", "b", "b"])
        {'accuracy': 0.6666666666666666}
        ```
        """

        def _info(self):
            return evaluate.MetricInfo(
                description="Exact-match accuracy of extracted answers (None never matches).",
                citation="",
                features=datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
                ),
            )

        def _compute(self, predictions, references):
            correct = [answers_match(p, r) for p, r in zip(predictions, references, strict=True)]
            return {"accuracy": sum(correct) / len(correct) if correct else float("nan")}

    return AnswerAccuracy


def __getattr__(name):
    if name == "AnswerAccuracy":
        cls = _build_answer_accuracy()
        globals()["AnswerAccuracy"] = cls
        return cls
    raise AttributeError(name)
