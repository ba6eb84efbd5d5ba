"""``python -m shardps.tools.bench``: see ``shardps.tools.bench``."""

import sys

from shardps.tools.bench.cli import main

sys.exit(main())
