import os
import sys

# Tests import tests.harness; keep the repo root importable however pytest is launched.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
