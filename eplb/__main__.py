"""``python -m eplb plan | report | simulate`` (``--help`` lists the options)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
