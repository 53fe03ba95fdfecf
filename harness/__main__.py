"""``python -m harness`` is ``offload-harness``."""

import sys

from harness.entry import main

sys.exit(main())
