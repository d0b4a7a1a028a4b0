"""The `jagg` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("jagg: set-up complete; the pipeline is not built yet.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
