"""The package's shape rules (CONTRIBUTING.md): short functions, one list of generation options."""

import ast
import inspect
import pathlib
from dataclasses import fields

import trl_unified
from trl_unified import generate_batched
from trl_unified.generation.options import GenerationOptions


PACKAGE = pathlib.Path(trl_unified.__file__).parent


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                long.append(
                    f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
                )
    assert not long, long


def test_generate_batched_keywords_are_the_generation_options_in_order():
    """generate_batched's keywords after `generation_config` are GenerationOptions' fields: same names, same order,
    same defaults (one list of options, documented once)."""
    parameters = inspect.signature(generate_batched).parameters
    keywords = list(parameters)[4 : 4 + len(fields(GenerationOptions))]
    assert keywords == [f.name for f in fields(GenerationOptions)]
    assert [parameters[name].default for name in keywords] == [f.default for f in fields(GenerationOptions)]
