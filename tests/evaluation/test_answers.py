import pytest

from trl_unified import AnswerAccuracy, answers_match, extract_answer


@pytest.mark.parametrize(
    "text, extractor, expected",
    [
        ("reasoning... <answer>Response A</answer>", "tags", "response a"),
        ("<answer> 7 </answer> then <answer>9</answer>", "tags", "9"),  # the last answer is the final one
        ("<ANSWER>\n  Yes.\n</ANSWER>", "tags", "yes"),  # case, whitespace and trailing period normalised
        ("<answer>   </answer>", "tags", None),  # empty is unparseable
        ("no tags here", "tags", None),
        ("<answer>cut off", "tags", None),
        ("so the result is \\boxed{42}", "boxed", "42"),
        ("\\boxed{\\frac{1}{2}} ok", "boxed", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{1} and \\boxed{2}", "boxed", "2"),
        ("\\boxed{unbalanced", "boxed", None),
        ("<answer>B</answer>", "boxed", None),
        ("\\boxed{3}", "auto", "3"),
        ("<answer>x</answer> \\boxed{3}", "auto", "x"),
        ("Score: 8/10", r"regex:Score:\s*(\d+)", "8"),
        ("nothing", r"regex:Score:\s*(\d+)", None),
    ],
)
def test_extract_answer(text, extractor, expected):
    assert extract_answer(text, extractor) == expected


def test_extract_answer_callable():
    assert extract_answer("anything", lambda s: " First ") == "first"


def test_unparseable_answer_is_never_correct():
    assert not answers_match(None, None)
    assert not answers_match(None, "a")
    assert not answers_match("a", None)
    assert answers_match("A.", " a")


def test_answer_accuracy_metric_follows_evaluate_interface():
    metric = AnswerAccuracy()
    assert metric.compute(predictions=["a", "", "B "], references=["a", "b", "b"]) == {"accuracy": 2 / 3}
    metric.add_batch(predictions=["x"], references=["x"])
    metric.add_batch(predictions=["y"], references=["z"])
    assert metric.compute() == {"accuracy": 0.5}
