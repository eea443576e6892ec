"""Entry point of `python -m checkpointing` (see checkpointing.cli)."""

import sys

from checkpointing.cli import main

sys.exit(main())
