"""Write docs/settings.md, the settings reference, from the config tree and the model families.

    python scripts/settings_reference.py           # rewrite docs/settings.md
    python scripts/settings_reference.py --check   # exit 1 when docs/settings.md is out of date

The Markdown comes from gpudl.config.reference.settings_markdown; tests/unit/test_settings_reference.py
compares the page with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpudl import models
from gpudl.config.reference import settings_markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def reference() -> str:
    """The page as the code describes it now: the config tree and each model family with its presets."""
    families = {family: (cls, {name: cfg for name, (fam, cfg) in models.PRESETS.items() if fam == family})
                for family, (cls, _) in models.FAMILIES.items()}
    return settings_markdown(families)


def main(argv: list[str]) -> int:
    text = reference()
    if "--check" in argv:
        current = PAGE.read_text(encoding="utf8") if PAGE.is_file() else ""
        print("docs/settings.md is up to date" if current == text else "docs/settings.md is out of date")
        return 0 if current == text else 1
    PAGE.write_text(text, encoding="utf8")
    print(f"Wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
