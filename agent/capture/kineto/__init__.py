"""PyTorch captures: the agent as the node's Kineto on-demand daemon.

``protocol``: the datagrams PyTorch processes exchange with the daemon (pure encode and decode).
``daemon``: the daemon itself, its socket and its directories (``KinetoDaemon``).
``backend``: the capture backend that asks a registered process for a trace (``KinetoBackend``).
"""
