"""Answer extraction and matching for generative evaluation accuracy, and an `evaluate` metric built on it."""

import math
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


ANSWER_EXTRACTORS = {"tags": _extract_tags, "boxed": _extract_boxed, "auto": _extract_auto}


def normalize_answer(answer: str | None) -> str | None:
    """Lower-case, collapse whitespace and strip surrounding whitespace and a trailing period; `None` stays `None`."""
    if answer is None:
        return None
    normalized = " ".join(str(answer).split()).lower().rstrip(".").strip()
    return normalized or None


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
        pattern = extractor.removeprefix("regex:")
        answers = [m.group(1) if m.groups() else m.group(0) for m in re.finditer(pattern, text, re.DOTALL)]
        return normalize_answer(answers[-1] if answers else None)
    return normalize_answer(ANSWER_EXTRACTORS[extractor](text))


def _as_number(answer: str | None) -> float | None:
    """The number an answer spells (`"2"`, `"2.0"`, `"-3.5"`, `"1,000"`, `"1e3"`), or None."""
    if answer is None:
        return None
    text = answer.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", answer) else answer
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def reference_answers(value, where: str = "reference answer") -> list[str] | None:
    """A reference answer as the normalised strings it accepts: a string (or a number, as a pandas column with a
    missing value turns integers into floats) is one answer; a list or tuple lists aliases, any of which is correct;
    None (or an empty list) means the row has no reference. Anything else raises a `TypeError` naming `where`."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{where} is a bool ({value!r}): give the answer as a string or a number.")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return None  # NaN: a missing value in a pandas column
        return [normalize_answer(repr(value) if isinstance(value, float) else str(value))]
    if isinstance(value, str):
        answer = normalize_answer(value)
        return [answer] if answer is not None else None
    if isinstance(value, (list, tuple)):
        return [a for item in value for a in (reference_answers(item, where) or [])] or None
    raise TypeError(
        f"{where} is a {type(value).__name__} ({str(value)[:60]!r}); a reference answer is a string, a number, or "
        "a list of accepted answers."
    )


def answers_match(predicted: str | None, reference) -> bool:
    """True when the predicted answer equals the reference after normalisation, or numerically when both parse as
    numbers (`"2"` matches `2.0`). `reference` may be a string, a number or a list of accepted answers (any of
    them). An unparseable prediction, or a missing reference, is never correct."""
    predicted = normalize_answer(predicted)
    accepted = reference if isinstance(reference, list) else reference_answers(reference)
    if predicted is None or not accepted:
        return False
    number = _as_number(predicted)
    for answer in accepted:
        answer = normalize_answer(answer)
        if answer == predicted:
            return True
        expected = _as_number(answer)
        if number is not None and expected is not None and math.isclose(number, expected, rel_tol=1e-9, abs_tol=1e-12):
            return True
    return False


def _build_answer_accuracy():
    # `evaluate` imports transformers.pipelines (seconds and tens of MB): only pay for it when the metric is used.
    import datasets
    import evaluate

    class AnswerAccuracy(evaluate.Metric):
        """`evaluate` metric: the fraction of predictions that match their reference (`answers_match`); an unparseable
        prediction (passed as `""`: `evaluate` takes strings only) and an empty reference count as wrong."""

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
        globals()["AnswerAccuracy"] = cls = _build_answer_accuracy()
        return cls
    raise AttributeError(name)
