import sys

from pipetrain.cli import main

sys.exit(main())
