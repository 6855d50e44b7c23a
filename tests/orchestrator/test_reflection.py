"""gRPC server reflection: the services are listed, and Generate is called with a request built
only from the reflected descriptors (what grpcurl does without the .proto file)."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness


def test_reflection_lists_services_and_drives_generate():
    h = Harness()
    try:
        with grpc.insecure_channel(h.address) as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            assert set(db.get_services()) >= {"orch.v1.Orch", "grpc.health.v1.Health",
                                              "grpc.reflection.v1alpha.ServerReflection"}
            pool = descriptor_pool.DescriptorPool(db)
            method = pool.FindServiceByName("orch.v1.Orch").methods_by_name["Generate"]
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            request = request_cls()
            request.token_ids.ids.extend([5, 6, 7])
            request.sampling.max_tokens = 4
            call = channel.unary_stream("/orch.v1.Orch/Generate",
                                        request_serializer=request_cls.SerializeToString,
                                        response_deserializer=response_cls.FromString)
            responses = list(call(request, timeout=10))
        assert [t for r in responses for t in r.token_ids] == expected_tokens((5, 6, 7), 4)
        assert responses[-1].finish_reason == "length"
    finally:
        h.close()
