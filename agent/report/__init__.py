"""`gpuscope report`: GPU-hours held, used and wasted per owner, computed by a Prometheus-compatible server.

`client` speaks the Prometheus HTTP query API (urllib, bounded responses); `promql` writes the
queries; `build` runs them and assembles one row per owner.
"""
