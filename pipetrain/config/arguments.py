"""The command lines' argument parser: argparse's, with its errors on one line.

Bad input exits 2 with one `error: ...` line that names the problem and the fix; argparse's own error()
prints the usage block first, then `prog: error: message`. Every pipetrain command builds its parser from
this class (sub-commands inherit it through add_subparsers)."""
from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        sys.stderr.write(f"error: {self.prog}: {message}; see {self.prog} --help\n")
        sys.exit(2)
