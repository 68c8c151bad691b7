"""``python -m deepinfer.serving.healthcheck HOST:PORT``: exit 0 when the gRPC server reports SERVING.

For container health checks and startup probes (the image has no grpc_health_probe)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            res = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return res.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and check(sys.argv[1]) else 1)
