"""``python -m shardps.tools.bench.probe RSS_FILE ARGS...``: run ``shardps ARGS...`` in this process,
then write ``{"exit_code": .., "peak_rss_kb": ..}`` to RSS_FILE.

The memory benchmark starts real ``shardps worker`` processes through this wrapper, so it
reads each worker's peak resident memory (VmHWM) as the process saw it, not by polling.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print("usage: python -m shardps.tools.bench.probe RSS_FILE SUBCOMMAND [ARGS...]", file=sys.stderr)
        return 2
    rss_file, rest = argv[0], argv[1:]
    from shardps.tools.bench.common import self_peak_rss_kb
    from shardps.tools.cli import main as shardps_main
    code = shardps_main(rest)
    with open(rss_file, "w") as f:
        json.dump({"exit_code": code, "peak_rss_kb": self_peak_rss_kb()}, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
