"""mkdocs hook: pages take parts of README.md, so there is one copy of each.

In a page, a line `<!-- README: snippet -->` becomes README's first
```` ```python ```` block, and `<!-- README: ## Some heading -->` the body of
that README section (up to the next `## ` heading). Links README makes to
`docs/page.md` become `page.md`, named by the page's title in the nav. A
marker that finds nothing fails the build.
"""

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

_MARKER = re.compile(r"^<!-- README: (.+?) -->$", re.MULTILINE)


def _part(readme, what):
    if what == "snippet":
        found = re.search(r"^```python\n.*?^```$", readme, re.MULTILINE | re.DOTALL)
        return found and found.group(0)
    found = re.search(rf"^{re.escape(what)}\n(.*?)(?=^## |\Z)", readme,
                      re.MULTILINE | re.DOTALL)
    return found and found.group(1).strip()


def on_page_markdown(markdown, page, config, files):
    if "<!-- README: " not in markdown:
        return markdown
    readme = (Path(config.config_file_path).parent / "README.md").read_text()

    def replace(match):
        part = _part(readme, match.group(1))
        if not part:
            raise PluginError(f"{page.file.src_path}: README.md has no "
                              f"{match.group(1)!r} to include")
        return re.sub(r"\[([^\]]*)\]\(docs/([^)]*)\)",
                      lambda m: f"[{titles.get(m[2], m[1])}]({m[2]})", part)

    titles = {file: title for item in config.nav or [] if isinstance(item, dict)
              for title, file in item.items()}

    return _MARKER.sub(replace, markdown)
