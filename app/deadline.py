"""A request's deadline over the stages before its queue: the body arriving, the image
waiting for a decode thread. (The batcher keeps the deadline from the queue on.)

A stalled upload or a decode backlog must not keep a request past its deadline (nor, for a
decode, its seat in the lane held): at the deadline the stage is cancelled and the request answered 503
``deadline_exceeded``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType

from app.errors import DeadlineExceeded


class within:  # noqa: N801 - used as a statement: ``async with within(deadline, "..."):``
    """Cancel the block at ``deadline`` (``time.monotonic()``), raising ``DeadlineExceeded``
    that says the request's deadline passed ``where``. ``expired()`` is called when the block
    ends by the deadline: cut off, or raising ``DeadlineExceeded`` itself."""

    __slots__ = ("_deadline", "_expired", "_timeout", "_where")

    def __init__(self, deadline: float, where: str, expired: Callable[[], None] = lambda: None) -> None:
        self._deadline, self._where, self._expired = deadline, where, expired
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()  # its clock may be another's than time.monotonic()
        self._timeout = asyncio.timeout_at(loop.time() + (self._deadline - time.monotonic()))
        await self._timeout.__aenter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._timeout is not None
        try:
            await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            self._expired()
            raise DeadlineExceeded(f"the request's deadline passed {self._where}") from None
        if isinstance(exc, DeadlineExceeded):
            self._expired()
