"""Protobuf contracts and their generated stubs (regenerate with ``python -m protos.generate``)."""
