"""Function-local imports say why (issue 59, item 3). An import inside a function or method is there only where it
breaks a real cost: rclpy and the generated interfaces off the ROS-free paths, torch, transformers, llama_cpp, redis,
matplotlib and the like off the paths that do not need them, an import cycle. A comment says which, on the import's
own line or on the line directly above its block of consecutive imports (blank lines between them allowed; a comment
that is only a tool's directive, `# noqa: F401`, says nothing). Any other import belongs at the module's top."""
from __future__ import annotations

import ast
import glob
import io
import os
import re
import tokenize

import simllm_ros

ROOT = os.path.dirname(simllm_ros.__file__)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# what a comment may hold besides a reason: lint and type-check directives
DIRECTIVE = re.compile(r"\bnoqa\b(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|\btype:\s*ignore(\[[^\]]*\])?", re.I)


def _comments(source: str) -> dict[int, str]:
    """line number -> the comment on it"""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def _says_why(comment: str | None) -> bool:
    return comment is not None and re.search(r"\w", DIRECTIVE.sub("", comment.lstrip("#"))) is not None


def _local_blocks(tree: ast.Module, lines: list[str]) -> list[list[ast.stmt]]:
    """The imports inside functions, as blocks: sibling import statements with nothing but blank lines between."""
    blocks: list[list[ast.stmt]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for _, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            run: list[ast.stmt] = []
            for child in children:
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                    between = lines[run[-1].end_lineno:child.lineno - 1] if run else []
                    if run and not any(line.strip() for line in between):  # only blank lines since the last one
                        run.append(child)
                    else:
                        if run:
                            blocks.append(run)
                        run = [child]
                    continue
                if run:
                    blocks.append(run)
                    run = []
                if isinstance(child, ast.AST):
                    visit(child, in_function or isinstance(child, FUNCTIONS))
            if run:
                blocks.append(run)

    visit(tree, False)
    return blocks


def unexplained(source: str, name: str) -> list[str]:
    """`name:line  import ...` for each function-local import of `source` that no comment explains."""
    lines = source.splitlines()
    comments = _comments(source)
    out = []
    for block in _local_blocks(ast.parse(source), lines):
        above = block[0].lineno - 1
        block_comment = comments.get(above) if above >= 1 and lines[above - 1].lstrip().startswith("#") else None
        for stmt in block:
            own = [comments.get(n) for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)]
            if not _says_why(block_comment) and not any(_says_why(c) for c in own):
                out.append(f"{name}:{stmt.lineno}  {ast.unparse(stmt)}")
    return out


def test_the_check_finds_an_unexplained_local_import():
    source = '''import os


def covered():
    # local: torch is heavy
    import torch

    from x import y
    return torch, y


def trailing():
    import redis  # local: optional
    return redis


def bare():
    """doc"""
    import json
    return json


def directive_only():
    import llama_cpp  # noqa: F401
    return None


def not_above():
    # a comment about something else
    x = 1
    import numpy
    return x, numpy


class A:
    def method(self):
        try:
            from redis import Redis
        except ImportError:
            Redis = None
        return Redis
'''
    assert unexplained(source, "m.py") == ["m.py:19  import json", "m.py:24  import llama_cpp",
                                           "m.py:31  import numpy", "m.py:38  from redis import Redis"]
    assert unexplained("import os\n\nif os:\n    import sys\n", "m.py") == []  # module level, not in a function


def test_every_function_local_import_says_why():
    paths = sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True))
    assert len(paths) > 100 and os.path.join(ROOT, "cli", "query.py") in paths  # the scan sees the package
    found, seen = [], 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        name = os.path.relpath(path, os.path.dirname(ROOT))
        seen += sum(len(b) for b in _local_blocks(ast.parse(source), source.splitlines()))
        found += unexplained(source, name)
    assert seen > 50  # the walk finds local imports at all
    assert not found, ("function-local imports without a comment saying why (on the import's line or the line above "
                       "its block); move them to the module's top if nothing is gained by deferring them:\n"
                       + "\n".join(found))
