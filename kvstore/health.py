"""The standard ``grpc.health.v1.Health`` service beside each process's own API.

Kubernetes' native gRPC probes, Envoy and grpc-health-probe speak this protocol
and not Crescent's own ``Health`` RPCs, so every gRPC process (store node,
conductor, engine) serves it on its gRPC port: the overall status (service
``""``) and one per API service it hosts, all SERVING while the process takes
work and NOT_SERVING from the moment it starts to stop (a store node's drain).
"""

from __future__ import annotations

import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthStatus:
    """The health service of one gRPC server; ``set_serving(False)`` flips every service it names."""

    def __init__(self, server: grpc.Server, *services: str) -> None:
        self.services = ("", *services)
        self._servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.set_serving(True)

    def set_serving(self, serving: bool, service: str | None = None) -> None:
        """Every service's status, or one's (e.g. a conductor follower: alive, but not scheduling)."""
        for s in self.services if service is None else (service,):
            self._servicer.set(s, SERVING if serving else NOT_SERVING)

    def stop(self) -> None:
        """Ends open Watch streams (they would otherwise hold the server's stop)."""
        self._servicer.enter_graceful_shutdown()


_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def advertised_host(listen_host: str, advertise_host: str | None = None) -> str:
    """The host other processes reach a server at: ``advertise_host`` if given, else the
    listen host unless that is a wildcard (0.0.0.0, [::]), which no peer can dial: then
    this machine's hostname."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if listen_host in _WILDCARDS else listen_host
