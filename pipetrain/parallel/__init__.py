"""Parallelism applied to the plain model from outside: dims, comm, tensor, pipeline, schedules, zero."""
