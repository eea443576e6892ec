"""Side-by-side benchmarks against peers; one entry point for the modules that do the work.

    python benchmarks/peers.py recovery   [...]   R1/R2 vs Ray Train TorchTrainer   (peer_raytrain.py)
    python benchmarks/peers.py throughput [...]   O1 vs a plain DDP loop in Ray actors (peer_ddp.py)
    python benchmarks/peers.py checkpoint [...]   C1/C2 vs DCP's synchronous save     (peer_dcp.py)

Each prints one JSON line; `--plot PATH` writes a PNG; `--help` after the name lists the options.
`make bench` runs a quick set of all three, `make bench-full` the settings of BENCHMARKS.md.
"""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COMMANDS = {"recovery": "peer_raytrain", "throughput": "peer_ddp", "checkpoint": "peer_dcp"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
