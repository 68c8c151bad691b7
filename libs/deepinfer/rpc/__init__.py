"""gRPC plumbing shared by the services: code generation and conversions between wire and engine types."""
