"""PyTorch captures: the agent as the node's Kineto on-demand daemon.

``protocol``: the datagrams PyTorch processes exchange with the daemon (pure encode and decode).
``directories``: the socket and trace directories it shares with the processes, and their modes.
``daemon``: the daemon itself (``KinetoDaemon``): registrations, trace requests, the socket.
``backend``: the capture backend that asks a registered process for a trace (``KinetoBackend``).
``errors``: what the daemon raises.
"""
