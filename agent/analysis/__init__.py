"""Profiler traces read into one event model and diagnosed into findings."""
