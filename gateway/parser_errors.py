"""Requests aiohttp's HTTP parser refuses before any middleware runs (a request line or header
over its limit, a Content-Encoding no installed decoder reads): JSON errors like the rest."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest

from gateway.errors import UNSUPPORTED_ENCODING, json_error
from gateway.read_timeouts import break_body

log = logging.getLogger(__name__)


class _Protocol(web.RequestHandler):
    """A connection whose parser's refusals (4xx) are answered in JSON."""

    _body: StreamReader | None = None
    """The body of the last request the parser read the head of (read on, or read whole)."""
    _broken: tuple[StreamReader, str] | None = None
    """A body whose chunked framing broke before its request's route started, and why."""

    def data_received(self, data: bytes) -> None:
        """Parses what arrived; a refusal part-way through a body (a chunk size that is not hex)
        ends that body where it broke, for the route to refuse it (aiohttp's C parser leaves it
        unended, so the route waited out HYATLAS_BODY_TIMEOUT). The body is the one the parser
        was in, whether its route reads it already or its request still waits in the queue (the
        head read in an earlier piece of data, or behind a pipelined request)."""
        queued = len(self._messages)
        super().data_received(data)
        for message, payload in list(self._messages)[queued:]:
            if not isinstance(message, _ErrInfo):
                self._body = payload
                continue
            body = self._body
            if body is None or body.is_eof():
                return  # between requests: handle_error answers it
            why = (message.message or "unparsable").splitlines()[0]
            request = self._current_request
            if request is not None and request.content is body:
                break_body(request, why)
                self.close()  # after the route's answer: what follows cannot be parsed
            else:
                # Closed once its request is served, not now: the requests queued before it
                # would go unanswered.
                body.feed_eof()
                self._broken = (body, why)
            return

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        """Serves a request; one whose body broke while it waited is told so first, and the
        connection closes after its answer (what follows the break cannot be parsed)."""
        if self._broken is not None and self._broken[0] is request.content:
            break_body(request, self._broken[1])
            self.close()
        return await super()._handle_request(request, start_time, request_handler)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A JSON error for a request the parser refused; aiohttp's own answer otherwise."""
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        # aiohttp's words may run on over lines (the bytes it stopped at, a caret): the first.
        text = f"bad request: {(message or 'unparsable').splitlines()[0].strip()}"
        if isinstance(exc, ContentEncodingError):
            status, text = 415, UNSUPPORTED_ENCODING
        log.info("refused a request from %s before routing: %s", request.remote, message)
        response = json_error(status, text)
        response.force_close()  # what is left of the request cannot be parsed
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's log of an exception while serving a connection; a body that does not
        decode, answered 400 already (read_timeouts), is met again when aiohttp reads what is
        left of it after the answer: that is no failure of the gateway's."""
        if isinstance(kw.get("exc_info"), RequestPayloadError):
            log.info("closed a connection whose request body does not decode: %s",
                     str(kw["exc_info"]).splitlines()[-1].strip())
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections answer the parser's refusals in JSON."""

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            **made._kwargs,
        )
