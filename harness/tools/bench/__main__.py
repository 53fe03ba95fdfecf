"""``python -m harness.tools.bench``: the same as ``offload-harness bench``."""

import sys

from harness.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
