"""``python -m shardps.bench``: see ``shardps.bench``."""

import sys

from shardps.bench.cli import main

sys.exit(main())
