"""A WAN-like link in front of an S3 server on 127.0.0.1: one-way latency and a bandwidth
cap per connection, for benchmarks (this kernel has no netem qdisc).

Every byte is delayed by `delay` in each direction, so a request costs at least one round
trip of 2 x delay; each connection's download is paced to `bandwidth` bytes/s (a token
bucket), as a real S3 connection is limited. Requests on one connection may still be
pipelined, like on a real link.

    python -m benchmarks.wanproxy --upstream 127.0.0.1:8333 --delay-ms 12 --mbps 80

prints `listening HOST:PORT` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

PIECE = 256 << 10  # (64 KiB cost the proxy 1.1 s of CPU per GiB, 256 KiB 0.8 s)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                rate: float) -> None:
    """Copy one direction: each piece leaves `delay` after it arrived, paced to `rate`."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        while True:
            data = await reader.read(PIECE)
            await queue.put((time.monotonic() + delay, data))
            if not data:
                return

    async def deliver() -> None:
        sent_until = 0.0  # when the link is free again (pacing)
        while True:
            due, data = await queue.get()
            if not data:
                break
            now = time.monotonic()
            start = max(due, sent_until)
            if start > now:
                await asyncio.sleep(start - now)
            writer.write(data)
            await writer.drain()
            sent_until = max(time.monotonic(), start) + (len(data) / rate if rate else 0)
        with contextlib.suppress(OSError):
            writer.write_eof()

    receiver = asyncio.create_task(receive())
    try:
        await deliver()
    finally:
        receiver.cancel()


async def _serve(args: argparse.Namespace) -> None:
    up_host, up_port = args.upstream.rsplit(":", 1)
    delay = args.delay_ms / 1000
    rate = args.mbps * 1e6 if args.mbps else 0.0

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(up_host, int(up_port))
        except OSError:
            cw.close()
            return
        try:
            # requests go up delayed (not paced), responses come down delayed and paced
            await asyncio.gather(_pump(cr, sw, delay, 0.0), _pump(sr, cw, delay, rate))
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (cw, sw):
                w.close()

    server = await asyncio.start_server(handle, args.host, args.port, limit=1 << 20)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=12.0, help="one-way latency")
    ap.add_argument("--mbps", type=float, default=80.0,
                    help="download cap per connection, MB/s (0: none)")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
