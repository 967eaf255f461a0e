"""``python -m cluster.cli``: how launchers and tests run ``pdserve`` in a child."""

import sys

from cluster.cli import main

sys.exit(main())
