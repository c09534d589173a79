"""A TCP proxy that gives each connection a bucket's per-stream limits: a fixed bandwidth each way and a round-trip
delay, so that a loopback store behaves like a remote one whose single stream is slow while many streams add up.

    python bench/throttle_proxy.py --listen PORT --upstream PORT --mib-per-s 12 --rtt-ms 20

Each accepted connection gets its own upstream connection and its own budget: bytes one way leave no faster than
``--mib-per-s`` (a token bucket per direction per connection, bursts of one 64 KiB read), and every chunk is held
``--rtt-ms / 2`` after it was read before it is passed on (a one-way delay: a request and its answer pay the whole
round trip, as a real link's first byte does). Connections are independent, as TCP flows to a bucket's front ends
are: the limits are per stream, not a shared pipe. Benchmarks only (bench/bench_transfers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import time

CHUNK = 64 << 10


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float, delay: float) -> None:
    """Copy ``reader`` to ``writer`` at most ``rate`` bytes/s, each chunk ``delay`` seconds late."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=64)

    async def read() -> None:
        sent, started = 0, time.monotonic()
        while data := await reader.read(CHUNK):
            # The rate: this chunk may be read once the bytes before it have had their time.
            sent += len(data)
            wait = started + sent / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -1.0:  # idle for a while (keep-alive between requests): no saved-up burst
                sent, started = len(data), time.monotonic()
            await queue.put((time.monotonic() + delay, data))
        await queue.put((time.monotonic() + delay, b""))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def serve(listen: int, upstream: int, mib_per_s: float, rtt_ms: float) -> None:
    rate, delay = mib_per_s * 2**20, rtt_ms / 2000

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer, rate, delay),
                             pipe(server_reader, client_writer, rate, delay))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--upstream", type=int, required=True)
    parser.add_argument("--mib-per-s", type=float, default=12.0, help="per connection, each way")
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    args = parser.parse_args()
    serve(args.listen, args.upstream, args.mib_per_s, args.rtt_ms)
