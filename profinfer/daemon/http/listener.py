"""An HTTP/1.1 server a hostile client cannot hold: one request per connection, read whole
(head and body) under one deadline by an asyncio loop in a thread of its own, so that a
client sending a byte every few seconds costs a socket and a buffer, never a worker, and is
closed when its deadline passes. Connections are counted when accepted (with TLS, before
the handshake, which runs under the request's deadline). At most `max_connections` are open,
and at most a quarter of them from one peer address: a new one over either cap closes the
oldest of its own peer's (over the peer cap) or of the peer holding the most (over the
total), whatever it is doing (sending its request, or holding its answer unread): a client
hogging the cap loses its own connections, one with few (the kubelet's probe) always gets in.
Each request's work runs in a bounded thread pool, its lane (a capture may take minutes: it
must not take the workers that answer /metrics); a lane with no free worker and no room in its
queue is answered 503 at once. What a route answers at once (/healthz, errors: O(1)) is sent
by the loop without a worker. Handlers never touch the socket: the loop sends their answer,
under a deadline too, in pieces (the transport holds no second copy of a big body).

The loop's thread and the workers use at most `cpu_share` of a CPU together: over it, work
for the lanes waits (the loop itself never sleeps: it keeps accepting, reading, evicting and
answering what needs no worker, so /healthz is never queued behind a flood). The agent loop
shares the interpreter: a thread busy answering a flood holds the GIL, and each of the
agent's reads of /proc would wait for it (bench/results.md has what that did unthrottled).
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import queue
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from http.client import HTTPMessage, parse_headers
from io import BytesIO
from typing import Callable
from urllib.parse import parse_qs, urlsplit

MAX_HEAD = 16 * 1024          # request line and headers
MAX_BODY = 64 * 1024          # no endpoint takes a body; a small form is let through
SEND_RATE = 256 * 1024        # bytes a second a reader must take its answer at, at least
SEND_PIECE = 1024 * 1024      # an answer is handed to the transport this much at a time
PEER_SHARE = 4                # one peer address may hold 1/PEER_SHARE of the connections
THROTTLE_CHECK_S = 0.05       # how often the loop's CPU use is looked at
MAX_PAUSE_S = 0.5


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: HTTPMessage
    body: bytes
    peer: str                 # the client's address (an IPv4-mapped one as IPv4)


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    after_send: Callable[[], None] | None = None   # called once the answer is sent, or failed


@dataclass
class Lane:
    workers: int
    waiting: int              # requests waiting for a worker, beyond which: 503 at once
    busy: int = 0             # running or waiting (counted on the loop)
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


# route(request) -> a Response to send at once (cheap: runs on the loop), or (lane, work):
# work() runs on one of the lane's workers and returns the Response
Route = Callable[[Request], "Response | tuple[str, Callable[[], Response]]"]


def peer_address(sockaddr) -> str:
    host = sockaddr[0] if isinstance(sockaddr, tuple) else ""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


@dataclass
class _Conn:
    task: asyncio.Task
    peer: str


class BoundedHTTPServer:
    def __init__(self, host: str, port: int, route: Route, lanes: dict[str, Lane], *,
                 max_connections: int, request_deadline_s: float, send_deadline_s: float,
                 dropped: Callable[[str], None] = lambda reason: None, ssl_context=None,
                 cpu_share: float = 0.2):
        """Binds now (an address in use is an OSError here); serves once start() is called.
        dropped(reason) is told of each connection cut short: "evicted" (the oldest of the
        peer over its share or holding the most, for a new one), "deadline" (its request not whole
        in time: 408), "too_large" (431, 413), "malformed" (400), "send_deadline" (its
        answer not taken in time)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=128)
        self.sock.setblocking(False)
        self.route = route
        self.lanes = lanes
        self.max_connections = max_connections
        self.max_per_peer = max(1, max_connections // PEER_SHARE)
        self.request_deadline_s = request_deadline_s
        self.send_deadline_s = send_deadline_s
        self.dropped = dropped
        self.ssl_context = ssl_context
        self.cpu_share = cpu_share
        self._cpu_mark = (0.0, 0.0)          # (monotonic, the loop's and workers' CPU time)
        self._workers_cpu = 0.0              # what the workers' jobs used, summed
        self.conns: OrderedDict[asyncio.Task, _Conn] = OrderedDict()   # in the order accepted
        self.per_peer: dict[str, int] = {}
        self._budget: asyncio.Event | None = None      # set while lane work may start (the throttle)
        self.loop = asyncio.new_event_loop()
        self.thread: threading.Thread | None = None
        self._server = None
        self._stopped = asyncio.Event()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self) -> None:
        # daemon threads: a capture under way does not hold the daemon's exit
        for name, lane in self.lanes.items():
            for i in range(lane.workers):
                threading.Thread(target=self._worker, args=(lane,), name=f"http-{name}-{i}", daemon=True).start()
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.loop.call_soon_threadsafe(self._stopped.set)
            self.thread.join(10)
            for lane in self.lanes.values():
                for _ in range(lane.workers):
                    lane.jobs.put(None)
        else:
            self.sock.close()
            self.loop.close()

    def _worker(self, lane: Lane) -> None:
        while (job := lane.jobs.get()) is not None:
            work, done = job
            began = time.thread_time()
            answer = _run_work(work)
            self._workers_cpu += time.thread_time() - began    # a statistic: a lost add is no harm
            try:
                self.loop.call_soon_threadsafe(_settle, lane, done, answer)
            except RuntimeError:              # the loop has closed
                pass

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    def _throttle(self) -> None:
        """Hold lane work back for as long as the loop and the workers have used over
        cpu_share since the last look (a long pause is made in turns: what is left is owed).
        The loop goes on meanwhile: what it does alone (accept, read, /healthz) stays quick."""
        now, cpu = time.monotonic(), time.thread_time() + self._workers_cpu
        wall, used = now - self._cpu_mark[0], cpu - self._cpu_mark[1]
        over = used / self.cpu_share - wall
        pause = min(over, MAX_PAUSE_S) if over > 0 else 0.0
        owed = max(0.0, over - MAX_PAUSE_S)
        # the pause is counted as time passed: the next look starts where it ends
        self._cpu_mark = (now + pause, cpu - owed * self.cpu_share)
        if pause:
            self._budget.clear()
            self.loop.call_later(pause, self._budget.set)
        self.loop.call_later(max(pause, THROTTLE_CHECK_S), self._throttle)

    async def _serve(self) -> None:
        self._budget = asyncio.Event()
        self._budget.set()
        self._cpu_mark = (time.monotonic(), time.thread_time() + self._workers_cpu)
        self.loop.call_later(THROTTLE_CHECK_S, self._throttle)
        # plain accept, TLS after the connection is counted: a half-open handshake holds a
        # counted place (and its deadline), never an uncounted descriptor
        self._server = await asyncio.start_server(self._connection, sock=self.sock, limit=MAX_HEAD)
        async with self._server:
            await self._stopped.wait()
            self._server.close()
            for task in list(self.conns):
                task.cancel()

    # ---- one connection ----

    def _make_room(self, peer: str) -> None:
        """Over the peer's share: its own oldest connection goes; over the total: the oldest
        of the peer holding the most."""
        if self.per_peer.get(peer, 0) >= self.max_per_peer:
            victim_peer = peer
        elif len(self.conns) >= self.max_connections:
            victim_peer = max(self.per_peer, key=self.per_peer.__getitem__)
        else:
            return
        victim = next(t for t, c in self.conns.items() if c.peer == victim_peer)
        self._forget(victim)
        victim.cancel()
        self.dropped("evicted")

    def _forget(self, task: asyncio.Task) -> None:
        conn = self.conns.pop(task, None)
        if conn is not None:
            left = self.per_peer[conn.peer] - 1
            if left:
                self.per_peer[conn.peer] = left
            else:
                del self.per_peer[conn.peer]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = peer_address(writer.get_extra_info("peername"))
        self._make_room(peer)
        self.conns[task] = _Conn(task, peer)
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        sent = False
        try:
            try:
                async with asyncio.timeout(self.request_deadline_s):
                    if self.ssl_context is not None:
                        await writer.start_tls(self.ssl_context)
                    request = await self._read(reader, peer)
            except TimeoutError:
                self.dropped("deadline")
                request = _error(408, "the request did not arrive whole in time")
            if isinstance(request, Response):
                sent = await self._send(writer, request, 1.0)
                return
            answer = await self._answer(request)
            sent = await self._send(writer, answer, self.send_deadline_s + len(answer.body) / SEND_RATE)
        except (asyncio.CancelledError, ConnectionError, OSError):   # evicted, closing, gone
            pass
        except asyncio.IncompleteReadError:   # the client went before its body was whole
            self.dropped("malformed")
        finally:
            self._forget(task)
            if sent:
                writer.close()                # all of it is with the kernel: a plain close
            else:
                writer.transport.abort()

    async def _read(self, reader: asyncio.StreamReader, peer: str) -> Request | Response:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            self.dropped("too_large")
            return _error(431, f"request head over {MAX_HEAD} bytes")
        except asyncio.IncompleteReadError:
            raise ConnectionResetError from None
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.dropped("malformed")
            return _error(400, "malformed request line")
        method, target, _ = parts
        try:
            headers = parse_headers(BytesIO(rest))
        except Exception:
            self.dropped("malformed")
            return _error(400, "malformed headers")
        if headers.get("Transfer-Encoding"):
            return _error(411, "a body must come with a Content-Length")
        try:
            length = int(headers.get("Content-Length") or 0)
        except ValueError:
            return _error(400, "bad Content-Length")
        if not 0 <= length <= MAX_BODY:
            self.dropped("too_large")
            return _error(413, f"request body over {MAX_BODY} bytes")
        body = await reader.readexactly(length) if length else b""
        try:
            url = urlsplit(target)
        except ValueError:                    # e.g. "http://[::1": an unclosed bracket
            self.dropped("malformed")
            return _error(400, "malformed request target")
        return Request(method, url.path, parse_qs(url.query), headers, body, peer)

    async def _answer(self, request: Request) -> Response:
        try:
            routed = self.route(request)
        except Exception as e:
            return _error(500, f"{type(e).__name__}: {e}")
        if isinstance(routed, Response):
            return routed
        name, work = routed
        lane = self.lanes[name]
        await self._budget.wait()             # the throttle: lane work only within cpu_share
        if lane.busy >= lane.workers + lane.waiting:
            return _error(503, f"busy: {lane.busy} {name} requests under way; try again later")
        lane.busy += 1           # until its work ends (a worker's, even if the client has gone)
        done = self.loop.create_future()
        lane.jobs.put((work, done))
        return await done

    async def _send(self, writer: asyncio.StreamWriter, r: Response, deadline_s: float) -> bool:
        """The answer, all of it handed to the kernel within deadline_s: True if it was."""
        try:
            phrase = HTTPStatus(r.status).phrase
        except ValueError:
            phrase = ""
        head = (f"HTTP/1.1 {r.status} {phrase}\r\nServer: profinfer\r\nContent-Type: {r.content_type}\r\n"
                f"Content-Length: {len(r.body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
        try:
            writer.transport.set_write_buffer_limits(high=SEND_PIECE)
            body = memoryview(r.body)
            async with asyncio.timeout(deadline_s):
                writer.write(head)
                for at in range(0, len(body), SEND_PIECE):
                    writer.write(body[at:at + SEND_PIECE])
                    await writer.drain()
                writer.transport.set_write_buffer_limits(high=0)    # drain() waits for all of it
                await writer.drain()
            return True
        except TimeoutError:
            self.dropped("send_deadline")
            return False
        finally:
            if r.after_send is not None:
                try:
                    r.after_send()
                except Exception:
                    pass


def _settle(lane: Lane, done: asyncio.Future, answer: Response) -> None:
    lane.busy -= 1
    if not done.done():
        done.set_result(answer)
    elif answer.after_send is not None:   # its connection went meanwhile: never to be sent
        try:
            answer.after_send()
        except Exception:
            pass


def _run_work(work: Callable[[], Response]) -> Response:
    try:
        return work()
    except Exception as e:                 # the daemon keeps serving
        return _error(500, f"{type(e).__name__}: {e}")


def _error(status: int, message: str) -> Response:
    return Response(status, (json.dumps({"error": message}) + "\n").encode(), "application/json")
