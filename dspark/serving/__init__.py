"""Serving code shared by the three services and the scheduler (docs/design.md section 7).

The core library (`dspark.engine`, `dspark.verifier`, the drafters) knows nothing of networks;
this package puts those same objects behind gRPC: the protocol stubs (`protos`), the tensor codec,
conversions between core dataclasses and messages, remote proxies that follow the core interfaces
(`RemoteVerifier`, `RemoteDrafter`), the request store, configs, metrics and tracing.
"""
