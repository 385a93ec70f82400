"""`python -m eqx_offload`: the command line, `eqx_offload.cli` (demo, bench)."""

import sys

from eqx_offload.cli import main as main


if __name__ == "__main__":
    sys.exit(main())
