"""PyTorch captures: the agent as the node's Kineto on-demand daemon.

``protocol``: the datagrams PyTorch processes exchange with the daemon (pure encode and decode).
``directories``: the socket and trace directories it shares with the processes, and their modes.
``daemon``: the daemon itself (``KinetoDaemon``): registrations, trace requests, the socket.
``backend``: the capture backend that asks a registered process for a trace (``KinetoBackend``).
``trace_wait``: how long it waits for the process to write its trace, and when it gives up.
``trace_copy``: the finished trace streamed into the capture, compressed, within its size cap.
``errors``: what the daemon raises.
"""
