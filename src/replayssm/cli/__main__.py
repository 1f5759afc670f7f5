"""``python -m replayssm.cli CMD ...``: the same as the ``replayssm`` console script."""

import sys

from . import main

sys.exit(main())
