"""The three DSpark services (DESIGN.md section 7): thin gRPC/REST wrappers around dspark."""
