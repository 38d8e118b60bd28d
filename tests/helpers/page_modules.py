"""The page's JavaScript (exporters/web/static) laid out for Node.js: the files under their own names beside a
package.json of type module, so that a runner there imports "./txl.js" and txl.js its modules, as the browser does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from txl_deploy.exporters.web.site import PAGE_FILES, _template_dir


def page_modules(folder: Path) -> Path:
    """Copy every JavaScript file the site ships into `folder` as ES modules; returns `folder`."""
    for name in PAGE_FILES:
        shutil.copyfile(_template_dir() / name, folder / name)
    (folder / "package.json").write_text(json.dumps({"type": "module"}))
    return folder
