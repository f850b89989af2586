"""The event stream of a streamed answer (jaxdecode/server/routes.py, EventStream): its framing, and
that a client who leaves ends it at once, while no event is due, whatever ASGI version the server
reports (from 2.4 on, Starlette's own streaming response only notices at its next write)."""

import asyncio

import pytest

from jaxdecode.server.routes import EventStream, _event


def _run(events, disconnect_after: float | None, spec: str):
    """Serve ``events`` to a fake client; returns the messages sent."""
    sent = []

    async def receive():
        if disconnect_after is None:
            await asyncio.Event().wait()  # never leaves
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}}
    asyncio.run(asyncio.wait_for(EventStream(events)(scope, receive, send), 5.0))
    return sent


@pytest.mark.quick
def test_events_are_data_lines_then_the_stream_ends():
    async def events():
        yield _event('{"a": 1}')
        yield _event("[DONE]")

    sent = _run(events(), None, "2.3")
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-store"
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert body == b'data: {"a": 1}\n\ndata: [DONE]\n\n'


@pytest.mark.quick
@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_who_leaves_closes_the_stream_while_it_waits(spec):
    closed = []

    async def events():
        try:
            yield _event("first")
            await asyncio.sleep(60)  # (a request in line: no event for a long time)
            yield _event("never")
        finally:
            closed.append(True)  # where the server aborts the request in the engine

    sent = _run(events(), 0.05, spec)
    assert closed == [True]
    assert b"never" not in b"".join(m.get("body", b"") for m in sent)
