"""The Extractor gRPC servicer: proto messages to worker calls and back."""

from __future__ import annotations

import grpc

from services.extractor.worker import Worker
from shared.errors import InvalidArgument
from shared.limits import check_reprocess
from shared.pb import extractor_pb2, extractor_pb2_grpc
from shared.redact import redact_url
from shared.rpc import grpc_errors
from shared.store_client import PAGE


class ExtractorServicer(extractor_pb2_grpc.ExtractorServicer):
    """Serves the Extractor contract."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    @grpc_errors
    async def ExtractMemory(
        self, request: extractor_pb2.ExtractMemoryRequest, context: grpc.aio.ServicerContext
    ) -> extractor_pb2.ExtractMemoryResponse:
        if not request.id:
            raise InvalidArgument("id is required")
        outcome = await self._worker.extract(request.scope, request.id, request.wait)
        return extractor_pb2.ExtractMemoryResponse(
            extraction_status=outcome.status, error=outcome.error
        )

    @grpc_errors
    async def Reprocess(
        self, request: extractor_pb2.ReprocessRequest, context: grpc.aio.ServicerContext
    ) -> extractor_pb2.ReprocessResponse:
        check_reprocess(request.ids, request.max, PAGE)
        counts = await self._worker.reprocess(list(request.ids), request.max)
        return extractor_pb2.ReprocessResponse(
            reprocessed=counts.reprocessed, failed=counts.failed, skipped=counts.skipped
        )

    @grpc_errors
    async def SetLlmKey(
        self, request: extractor_pb2.SetLlmKeyRequest, context: grpc.aio.ServicerContext
    ) -> extractor_pb2.SetLlmKeyResponse:
        key = request.key.strip()
        if not key:
            raise InvalidArgument("key is required")
        if any(ch.isspace() for ch in key) or key.startswith("{"):
            raise InvalidArgument("key must be a plain token (no spaces, not JSON)")
        self._worker.key_arrived(key)
        return extractor_pb2.SetLlmKeyResponse(llm=self._worker.llm_state())

    @grpc_errors
    async def GetLlmStatus(
        self, request: extractor_pb2.GetLlmStatusRequest, context: grpc.aio.ServicerContext
    ) -> extractor_pb2.GetLlmStatusResponse:
        extraction = self._worker.extraction
        counters = extraction.counters
        pipeline = f"degraded: {counters.last_error}" if counters.last_error else "ok"
        return extractor_pb2.GetLlmStatusResponse(
            llm=self._worker.llm_state(),
            llm_model=extraction.llm.model,
            llm_base=redact_url(extraction.llm.base),
            write_pipeline=pipeline,
            dropped_ops=counters.dropped_ops,
            extracted=counters.extracted,
            failed=counters.failed,
            refused_forgotten=counters.refused_forgotten,
            in_flight=self._worker.in_flight,
        )
