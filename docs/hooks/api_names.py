"""mkdocs hook: the API reference documents every name in `__all__`.

`docs/api.md` lists each public name as `::: keras_layoutmap.NAME`; a name
added to `keras_layoutmap/__init__.py`'s `__all__` without its entry there
(or an entry for a name that is gone) fails the build.
"""

import ast
import re
from pathlib import Path

from mkdocs.exceptions import PluginError


def _public_names(init):
    for node in ast.parse(init.read_text()).body:
        if (isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets)):
            return set(ast.literal_eval(node.value))
    raise PluginError(f"{init}: no __all__")


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "api.md":
        return markdown
    init = Path(config.config_file_path).parent / "keras_layoutmap" / "__init__.py"
    public = _public_names(init)
    documented = set(re.findall(r"^::: keras_layoutmap\.(\w+)$", markdown,
                                re.MULTILINE))
    if public != documented:
        raise PluginError(
            "docs/api.md and keras_layoutmap.__all__ differ: missing from the "
            f"page {sorted(public - documented)}, not public "
            f"{sorted(documented - public)}")
    return markdown
