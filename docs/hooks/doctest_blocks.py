"""Griffe extension: show docstring examples (doctest blocks) as code.

Our docstrings keep their examples as bare doctest blocks, which run as
tests (tests/test_docstrings.py). Markdown would read `>>>` as nested block
quotes, so each block (a `>>>` line, its `...` lines and its output, up to a
blank line) is fenced as `pycon` here, and `# doctest:` flags are dropped. The
source stays as it is.
"""

import re

import griffe

_FLAGS = re.compile(r"\s*# doctest:.*$")


def fence_doctests(text):
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(_FLAGS.sub("", lines[i]))
            i += 1
        out += [f"{indent}```pycon", *block, f"{indent}```"]
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
