"""python -m pipetrain.parallel.schedules: the timeline command (timeline.py)."""
from pipetrain.parallel.schedules.timeline import main

raise SystemExit(main())
