"""Alerts: rules over per-GPU history that recognise a wasted GPU while it is happening."""
