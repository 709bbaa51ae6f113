"""The tierkv daemon: one process per node that engines share (docs/daemon.md).

``tierkv serve --config FILE --socket PATH`` runs :class:`~tierkv.daemon.server.Daemon`; a store
whose config has ``daemon: PATH`` is a :class:`~tierkv.daemon.client.DaemonStore` talking to it.
Modules: ``protocol`` (frames), ``config`` (the daemon's file), ``server``, ``link`` (a client's
connection), ``client`` (the store).
"""
