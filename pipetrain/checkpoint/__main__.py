"""python -m pipetrain.checkpoint inspect|consolidate: see pipetrain.checkpoint.tools."""
import sys

from pipetrain.checkpoint.tools import main

sys.exit(main())
