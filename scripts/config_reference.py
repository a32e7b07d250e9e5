"""Write docs/config.md, the configuration reference, from the pydantic models in alignment/config/.

    python scripts/config_reference.py            # rewrite docs/config.md
    python scripts/config_reference.py --check    # exit 1 if docs/config.md is not what it would write

Every key's text is the `description=` of its field (`alignment/config/reference.py` renders them); edit those,
then rerun this. tests/test_config_reference.py fails while docs/config.md is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's package, also where another one is installed

from alignment.config.reference import markdown  # noqa: E402

TARGET = REPO / "docs" / "config.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that docs/config.md is current")
    args = parser.parse_args()
    rendered = markdown()
    if args.check:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != rendered:
            print(f"{TARGET.relative_to(REPO)} is stale: run `python scripts/config_reference.py`", file=sys.stderr)
            return 1
        print(f"{TARGET.relative_to(REPO)} is current")
        return 0
    TARGET.write_text(rendered)
    print(f"wrote {TARGET.relative_to(REPO)} ({len(rendered.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
