"""``python tests/ops/toy_cli.py <command> ...``: the fusedpar CLI with the toy op registered.
The spawned ranks of ``fusedpar check`` run this file again (as ``__mp_main__``), so they
register it too."""

import sys

import tests.ops.toy_op  # noqa: F401 - registers the toy op

if __name__ == "__main__":
    from fusedpar.cli import main

    sys.exit(main(sys.argv[1:]))
