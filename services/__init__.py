"""The three DSpark services (docs/design.md section 7): thin gRPC/REST wrappers around dspark."""
