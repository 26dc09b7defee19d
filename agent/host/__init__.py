"""What the host knows of the GPU processes: names and users (``processes``), containers
(``cgroup``), and the Kubernetes pods the kubelet allocated each GPU to (``kubelet``, ``pods``)."""
