"""Captures: short profiler traces of the processes on a GPU, taken when an alert fires or on demand."""
