"""The conductor: membership, the global prefix index, scheduling, admin, trace replay.

Modules, one responsibility each:

- ``config``: ``ConductorConfig`` (the ``crescent conductor`` flags).
- ``costmodel``: ``HardwareProfile`` and ``CostModel`` (prefill, transfer, decode
  times; the prefill part is refitted from measured prefill times).
- ``policy``: scheduling policies (random, round-robin, load, cache-local,
  cache-aware) over plain candidate dataclasses; shared by the live conductor
  and the trace simulator.
- ``index``: ``GlobalIndex`` (key → holders and tiers) and ``HotTracker``.
- ``membership``: members, heartbeats, the dead timeout, draining.
- ``service``: the ``crescent.v1.Conductor`` gRPC service and ``serve``.
- ``agent``: ``MemberAgent``, the member side (register, heartbeat, load
  reports, batched KV events) for store nodes and engines.
- ``client``: ``ConductorClient``, a typed client of the service.
- ``trace``, ``simulator``, ``report``: ``crescent ctl replay``.
- ``ctl``, ``cli``: ``crescent ctl`` and the argument parsers.
"""
