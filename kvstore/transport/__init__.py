"""Data movers over one descriptor protocol.

gRPC carries control; value bytes move one of four ways:

- ``grpc``: gRPC frames (kvstore/server.py ``Get``/``Put``), any network.
- ``tcp``: the raw TCP data channel (kvstore/datachannel.py).
- ``shm``: same host; the client maps the node's DRAM arena file and copies
  slots straight into or out of its own buffers (``shm.py``).
- ``rdma``: pyverbs; the client posts one-sided RDMA READ/WRITE against the
  node's registered arena (``rdma.py``).

The one-sided movers share the descriptor protocol: a client asks for a read
lease or a write reservation and gets, per key, the arena slots (with their
generations) under a lease id that expires ``lease_ttl_s`` after the grant
(``leases.py`` on the node, ``session.py`` on the client). It moves the bytes
itself, then releases (reads) or commits (writes).

Modules: ``descriptors`` (types shared by both ends), ``identity`` (same-host
detection and the automatic choice), ``leases`` (the node's lease table and
sweeper), ``service`` (the node's gRPC handlers), ``memcopy`` (parallel copy
plans), ``shm``, ``rdma``, ``gpu`` (CUDA staging), ``session`` (client side).
"""

from kvstore.transport.descriptors import Mover

__all__ = ["Mover"]
