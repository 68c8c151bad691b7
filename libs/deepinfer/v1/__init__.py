"""Generated protobuf / gRPC code of ``proto/deepinfer/v1`` (do not edit; ``python -m deepinfer.rpc.codegen``)."""
