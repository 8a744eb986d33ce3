"""python -m pipetrain.parallel.pipeline.schedules: the timeline command (timeline.py)."""
from pipetrain.parallel.pipeline.schedules.timeline import main

raise SystemExit(main())
