"""``python tools/convert.py --from FORMAT --input SRC --output URL ...`` from a clone.

The same as ``streamforge convert ...``; see ``docs/convert.md``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from streamforge.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
