"""The control API: the agent's own gRPC service (gpuscope.v1.Agent) and its client and configuration.

Local clients connect over a Unix socket (``control.socket``, mode 0660 by default); remote clients over
TCP only when ``control.tcp`` names TLS files and a bearer token. See ``server``, ``client`` and ``config``.
"""
