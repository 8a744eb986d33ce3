"""python -m pipetrain.hf export: see pipetrain.hf.export."""
import sys

from pipetrain.hf.export import main

sys.exit(main())
