"""The cluster's lifecycle: the top layer, which may import everything.

- :mod:`cluster.deployment`: the deployment file and the command lines it gives;
- :mod:`cluster.local`: ``--launcher process`` (plain processes on this machine);
- :mod:`cluster.ray_cluster`: placement on Ray, ``pdserve scale``;
- :mod:`cluster.redis_server`, :mod:`cluster.child`, :mod:`cluster.net`: starting
  Redis and child processes, picking ports;
- :mod:`cluster.cli`: the ``pdserve`` command, one module per command group.

Routers and workers never import this package (``lint-imports`` checks it); what they
share lives in :mod:`common`.
"""
