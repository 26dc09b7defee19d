"""Sampling the node: the sampler thread and what it derives from NVML's readings between ticks.

``sampler`` ticks and publishes Snapshots; ``node`` builds it (with the simulation and pod
attribution) from the settings; the others are its per-GPU state: busy time from utilization samples
(``busy_time``), counters across resets and rates integrated into totals (``counters``), energy split
among processes (``energy_split``), idle dips (``idle_dips``), and the watchdog's bookkeeping of NVML
calls that do not return (``read_guard``).
"""
