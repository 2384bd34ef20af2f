"""The package's shape rules (CONTRIBUTING.md): short functions, one list of generation options, and an
architecture page that names every module and every online hook."""

import ast
import inspect
import pathlib
import re
from dataclasses import fields

import trl_unified
from trl_unified import generate_batched
from trl_unified.generation.options import GenerationOptions


PACKAGE = pathlib.Path(trl_unified.__file__).parent


def _code_lines(node) -> int:
    """Lines of a function after its docstring (the code a reader holds)."""
    body = node.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
    first = body[1].lineno if has_docstring and len(body) > 1 else body[0].lineno
    return node.end_lineno - first + 1


def test_no_function_in_the_package_is_over_60_lines_of_code_or_80_in_all():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            total = node.end_lineno - node.lineno + 1
            if _code_lines(node) > 60 or total > 80:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({_code_lines(node)}/{total})")
    assert not long, long


def _architecture_tree() -> dict[str, set[str]]:
    """The module tree of docs/architecture.md: package (or "" for the top level) -> the `.py` names its lines give."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = doc[doc.index("trl_unified/\n") :]
    block = block[: block.index("```")]
    tree, package = {"": set()}, ""
    for line in block.splitlines()[1:]:
        heading = re.match(r"^  (\w+)/", line)
        if heading:
            package = heading.group(1)
            tree.setdefault(package, set())
            continue
        if re.match(r"^  \w+\.py", line):  # a top-level module ends the package above it
            package = ""
        tree[package].update(re.findall(r"\w+\.py", line))
    return tree


def test_architecture_names_every_module_under_its_package():
    tree = _architecture_tree()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        package = str(path.parent.relative_to(PACKAGE)).replace(".", "")
        if path.name not in tree.get(package, set()):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"docs/architecture.md's module tree lacks {missing}"


def test_architecture_lists_every_public_hook_of_the_online_core():
    """A public method the online core adds (`OnlineTrainer` or its mixins in `online/`; the base trainer's hooks are
    listed with it) that a trainer overrides is a hook: the hook table of docs/architecture.md ("The online family")
    names it."""
    import trl_unified.trainers as trainers
    from trl_unified.core.trainer import PolicyTrainerBase
    from trl_unified.online.trainer import OnlineTrainer

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## The online family") : doc.index("## The offline preference family")]
    core = set()
    for cls in OnlineTrainer.__mro__:
        if cls.__module__.startswith("trl_unified.online"):
            core |= {name for name, value in vars(cls).items() if inspect.isfunction(value) and name[0] != "_"}
    core -= set(dir(PolicyTrainerBase))
    overridden = set()
    for path in (PACKAGE / "trainers").glob("*.py"):
        module = __import__(f"{trainers.__name__}.{path.stem}", fromlist=["_"])
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, OnlineTrainer) and cls is not OnlineTrainer:
                overridden |= {name for name in core if name in vars(cls)}
    unlisted = sorted(name for name in overridden if f"`{name}(" not in table)
    assert overridden and not unlisted, f"the online hook table lacks {unlisted}"


def test_generate_batched_keywords_are_the_generation_options_in_order():
    """generate_batched's keywords after `generation_config` are GenerationOptions' fields: same names, same order,
    same defaults (one list of options, documented once)."""
    parameters = inspect.signature(generate_batched).parameters
    keywords = list(parameters)[4 : 4 + len(fields(GenerationOptions))]
    assert keywords == [f.name for f in fields(GenerationOptions)]
    assert [parameters[name].default for name in keywords] == [f.default for f in fields(GenerationOptions)]
