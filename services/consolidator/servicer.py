"""The Consolidator gRPC servicer: proto messages to domain calls and back."""

from __future__ import annotations

import dataclasses

import grpc

from services.consolidator.passes import Busy, Consolidator, Report
from shared.errors import InvalidArgument
from shared.pb import consolidator_pb2, consolidator_pb2_grpc
from shared.rpc import grpc_errors


def report_message(report: Report) -> consolidator_pb2.PassReport:
    """A pass report as the proto PassReport."""
    return consolidator_pb2.PassReport(**dataclasses.asdict(report))


class ConsolidatorServicer(consolidator_pb2_grpc.ConsolidatorServicer):
    """Serves the Consolidator contract over the domain Consolidator."""

    def __init__(self, consolidator: Consolidator, ultra: bool) -> None:
        self._consolidator = consolidator
        self._ultra = ultra

    @grpc_errors
    async def RunPass(
        self, request: consolidator_pb2.RunPassRequest, context: grpc.aio.ServicerContext
    ) -> consolidator_pb2.RunPassResponse:
        if not self._ultra:
            return consolidator_pb2.RunPassResponse(
                ran=False, reason="this mode has no slow path; consolidation runs only in ultra"
            )
        try:
            report = await self._consolidator.run_pass()
        except Busy as exc:
            return consolidator_pb2.RunPassResponse(ran=False, reason=exc.message)
        return consolidator_pb2.RunPassResponse(ran=True, report=report_message(report))

    @grpc_errors
    async def GetDigest(
        self, request: consolidator_pb2.GetDigestRequest, context: grpc.aio.ServicerContext
    ) -> consolidator_pb2.GetDigestResponse:
        c = self._consolidator
        reply = consolidator_pb2.GetDigestResponse(
            runs=c.runs, last_at=c.last_at, running=c.running
        )
        if c.last is not None:
            reply.last.CopyFrom(report_message(c.last))
        return reply

    @grpc_errors
    async def RevertPass(
        self, request: consolidator_pb2.RevertPassRequest, context: grpc.aio.ServicerContext
    ) -> consolidator_pb2.RevertPassResponse:
        if not request.pass_id:
            raise InvalidArgument("pass_id is required")
        undone = await self._consolidator.revert(request.pass_id, request.actor)
        return consolidator_pb2.RevertPassResponse(
            pass_id=request.pass_id,
            restored_ids=undone.restored_ids,
            undone_ids=undone.undone_ids,
            edge_ids=undone.edge_ids,
            kept_ids=undone.kept_ids,
            kept_why=undone.kept_why,
        )
