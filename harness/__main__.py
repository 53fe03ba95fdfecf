"""``python -m harness`` is ``offload-harness``."""

import sys

from harness.cli import main

sys.exit(main())
