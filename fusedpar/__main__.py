"""``python -m fusedpar info | check | train | bench`` (see fusedpar.cli)."""

import sys

from fusedpar.cli import main

if __name__ == "__main__":
    sys.exit(main())
