"""A subscriber to a vLLM engine's KV event stream, as a KV-aware router reads it: a ZMQ SUB
socket, each message (topic, 8-byte sequence number, msgpack payload) decoded with msgspec
alone, no vLLM classes. It binds ENDPOINT_BASE (`tcp://127.0.0.1:*` picks a free port) and
prints `READY <endpoint>`; the engine's publisher connects there (vLLM connects to a `tcp://`
endpoint without `*`). Every batch goes to OUT_JSONL as one line
{"seq", "ts", "events": [{"type": "BlockStored", ...}, ...]}, byte strings as hex. SIGTERM
ends it. Run in the clients venv (pyzmq and msgspec come with vLLM):

    python kv_events_subscriber.py ENDPOINT_BASE TOPIC OUT_JSONL
"""

from __future__ import annotations

import json
import signal
import sys

import msgspec
import zmq


def _plain(x):
    if isinstance(x, bytes):
        return x.hex()
    raise TypeError(f"cannot write {type(x).__name__}")


def main(endpoint: str, topic: str, out_path: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.bind(endpoint)
    print("READY " + sub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    with open(out_path, "w") as out:
        while not stop:
            if not sub.poll(100):
                continue
            _topic, seq, payload = sub.recv_multipart()
            # vLLM's EventBatch is array-like: [ts, events, data_parallel_rank]; each event a
            # map tagged with its class name ("type")
            batch = msgspec.msgpack.decode(payload)
            line = {"seq": int.from_bytes(seq, "big"), "ts": batch[0], "events": batch[1]}
            out.write(json.dumps(line, default=_plain) + "\n")
            out.flush()
    sub.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main(*sys.argv[1:4])
