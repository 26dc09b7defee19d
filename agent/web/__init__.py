"""The agent's HTTP side: the listening server (``server``) and its endpoints (``app``)."""
