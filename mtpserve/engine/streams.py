"""What the engine thread hands to the coroutines of an AsyncEngine (engine/async_engine.py): each request's
stream of outputs, and the errors a stream or a new request can end with."""
import asyncio


class QueueFullError(Exception):
    """Too many requests are waiting; the server answers 503 with Retry-After."""


class EngineError(Exception):
    """The engine failed while running this request."""


class EngineDeadError(Exception):
    """The engine loop has stopped."""


ADDED = object()   # first item of a stream: the engine accepted the request


def deliver(items: list[tuple["RequestStream", object]]) -> None:   # engine thread
    """Each item to its stream, one call_soon_threadsafe per event loop (each call writes to the loop's pipe)."""
    by_loop: dict = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:   # the event loop is closed: nobody is listening
            pass


def _put_all(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


class RequestStream:
    """One request's outputs, filled by the engine thread, read by one coroutine."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner):   # owner: the AsyncEngine
        self.request_id, self.loop, self.owner = request_id, loop, owner
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.aborted = False

    def put(self, item) -> None:   # engine thread
        deliver([(self, item)])

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = self.aborted = True
            self.owner.abort(self.request_id)
